// cuda_emu's scheduler: fibers for the threads of a block (of a cluster's blocks), barriers, warp-level intrinsics,
// launch checks (the semantics are written at the top of runtime.h; shared memory is shared_memory.cpp's).
#include "runtime.h"

#include <cxxabi.h>
#include <sys/mman.h>

// Fibers switch with a few instructions on x86-64, with ucontext elsewhere (or with -DCUDA_EMU_UCONTEXT).
#if defined(__x86_64__) && !defined(CUDA_EMU_UCONTEXT)
#define CUDA_EMU_ASM_SWITCH 1
#else
#define CUDA_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <new>
#include <sstream>
#include <vector>

#include "shared_memory.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

#if CUDA_EMU_ASM_SWITCH
// cuda_emu_switch(&save, to): saves the callee-saved registers and the FP control words on the current stack, stores
// its stack pointer in *save, and continues on stack `to` where an earlier switch saved it. (glibc's swapcontext
// makes a system call per switch, and ASan's interceptor clears the new stack's shadow each time: 50x slower.)
extern "C" void cuda_emu_switch(void** save, void* to);
asm(R"(
  .text
  .globl cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch, .-cuda_emu_switch
)");
#endif

namespace cuda_emu {
namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kGuardBytes = 4096;
constexpr int kMaxThreads = 1024;

// The __launch_bounds__ of every kernel, read from the headers by build.py: {"name", bound}, ...
struct LaunchBound {
  const char* kernel;
  int max_threads;
};
constexpr LaunchBound kLaunchBounds[] = {
#include "launch_bounds.inc"
};

struct Site {
  const char* file = nullptr;
  unsigned line = 0, column = 0;
  bool operator==(const Site& o) const {
    return line == o.line && column == o.column && (file == o.file || strcmp(file, o.file) == 0);
  }
  std::string str() const {
    const char* base = strrchr(file, '/');
    return std::string(base ? base + 1 : file) + ":" + std::to_string(line) + ":" + std::to_string(column);
  }
};
Site site_of(const std::source_location& s) {
  return {s.file_name(), static_cast<unsigned>(s.line()), static_cast<unsigned>(s.column())};
}

enum class State { kReady, kBarrier, kClusterBarrier, kWarp, kMbarrier, kDone };

// A saved execution context: a stack pointer (x86-64), or a ucontext elsewhere.
#if CUDA_EMU_ASM_SWITCH
using Context = void*;
#else
using Context = ucontext_t;
#endif

struct Fiber {
  Context context;
  char* stack = nullptr;  // kStackBytes above a guard page
  Coords coords;
  std::vector<std::pair<void*, const void*>> async_copies;  // started, not yet waited for (async_copy_push)
  int id = 0;     // in the cluster: block rank * threads per block + linear thread index
  int block = 0;  // its block's rank in the cluster
  int warp = 0;   // in the cluster: block rank * warps per block + warp in the block
  int lane = 0;
  State state = State::kReady;
  Site site;  // where it waits
  // The warp-level intrinsic it waits in.
  WarpKind kind = WarpKind::kSync;
  unsigned mask = 0;
  int lane_arg = 0, width = 32;
  uint64_t value = 0, result = 0;
  // The mbarrier it waits on, and the parity of the phase it waits for.
  const void* bar = nullptr;
  unsigned parity = 0;
};

// An mbarrier of a block of the running cluster (cluster.cuh's), by address.
struct MbarrierState {
  int block = 0;         // the rank whose shared memory holds it
  unsigned phase = 0;    // the current phase (its parity: phase & 1)
  int arrivals = 0;      // per phase
  int pending = 0;       // arrivals the current phase still awaits
  long long bytes = 0;   // announced minus landed, in the current phase
  int initializer = 0;   // the fiber that initialized it
  bool fenced = false;   // its initializer has reached cluster_sync_mbarrier_init since
  bool visible = false;  // a cluster barrier followed: the cluster's blocks may push to it
};

// A cluster_push in flight: its bytes land at `to` (in block `block`'s shared memory) and count on `bar`.
struct Push {
  int from = 0, block = 0;
  void* to = nullptr;
  const void* bar = nullptr;
  std::vector<unsigned char> value;
};

// A warp-level intrinsic some lanes of a warp wait in.
struct PendingWarpOp {
  unsigned mask;
  WarpKind kind;
  int width;
  Site site;
  unsigned arrived = 0;
};

// A block of the running cluster.
struct Block {
  int live = 0;  // threads not done
  // The __syncthreads barrier being gathered: its site and how many threads wait at it.
  Site barrier_site;
  int barrier_count = 0;
};

std::string hex(unsigned v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

std::string describe(const Coords& c) {
  std::ostringstream s;
  s << "block (" << c.block_idx.x << "," << c.block_idx.y << "," << c.block_idx.z << ") thread (" << c.thread_idx.x
    << "," << c.thread_idx.y << "," << c.thread_idx.z << ")";
  return s.str();
}

// The running launch's state. One launch at a time, on the OS thread that called run_grid; one cluster at a time
// (an ordinary launch's cluster is one block).
struct Runtime {
  Schedule schedule;
  std::map<std::string, int> launch_log;
  std::vector<char*> stacks;  // reused by every cluster
  Context scheduler;
  std::vector<Fiber> fibers;  // the cluster's threads, block by block
  std::vector<Block> blocks;  // by rank
  int threads_per_block = 0, warps_per_block = 0;
  std::deque<int> ready;
  Fiber* current = nullptr;
  int live = 0;  // fibers not done
  // The cluster_sync barrier being gathered: its site and how many threads wait at it.
  Site cluster_site;
  int cluster_count = 0;
  std::vector<std::vector<PendingWarpOp>> warp_ops;  // per warp
  std::vector<unsigned> live_lanes;                  // per warp: its lanes not done
  std::map<const void*, MbarrierState> mbarriers;
  std::deque<Push> pushes;  // in flight, oldest first
  std::string error;
  bool aborting = false;  // the launch failed: every fiber unwinds
  void (*run_thread)(void*) = nullptr;
  void* context = nullptr;
#if CUDA_EMU_ASAN
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  void* fake_stack = nullptr;
#endif
};
Runtime rt;

char* stack_for(int i) {
  while (static_cast<int>(rt.stacks.size()) <= i) {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    mprotect(p, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting the next stack
    rt.stacks.push_back(static_cast<char*>(p) + kGuardBytes);
  }
  return rt.stacks[i];
}

void switch_context(Context* save, Context* to) {
#if CUDA_EMU_ASM_SWITCH
  cuda_emu_switch(save, *to);
#else
  swapcontext(save, to);
#endif
}

// Switches from the scheduler into fiber f, and back when it parks or ends.
void resume(Fiber& f) {
  rt.current = &f;
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&rt.fake_stack, f.stack, kStackBytes);
#endif
  switch_context(&rt.scheduler, &f.context);
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(rt.fake_stack, nullptr, nullptr);
#endif
  rt.current = nullptr;
}

// Thrown inside a fiber to unwind its stack (destructors run) when its launch fails; fiber_entry catches it.
struct FiberAbort {};

// From a fiber back to the scheduler; returns when the scheduler resumes this fiber (throws FiberAbort when it
// resumes it to unwind a failed launch).
void park(Fiber& f) {
#if CUDA_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(f.state == State::kDone ? nullptr : &fake, rt.scheduler_stack_bottom,
                                 rt.scheduler_stack_size);
#endif
  switch_context(&f.context, &rt.scheduler);
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, &rt.scheduler_stack_bottom, &rt.scheduler_stack_size);
#endif
  if (rt.aborting && f.state != State::kDone) throw FiberAbort{};
}

[[noreturn]] void fail_in_fiber(const std::string& message) {
  if (rt.error.empty()) rt.error = message;
  throw FiberAbort{};
}

// Makes fibers ids[0..n) ready, in the schedule's order (ids ascending on entry).
void make_ready(const int* ids, int n) {
  switch (rt.schedule.order) {
    case Order::kForward:
      for (int i = 0; i < n; ++i) rt.ready.push_back(ids[i]);
      break;
    case Order::kReverse:
      for (int i = n - 1; i >= 0; --i) rt.ready.push_back(ids[i]);
      break;
    case Order::kGreedyHigh:  // released threads run first, the highest id first
      for (int i = 0; i < n; ++i) rt.ready.push_front(ids[i]);
      break;
    case Order::kGreedyLow:  // released threads run first, the lowest id first
      for (int i = n - 1; i >= 0; --i) rt.ready.push_front(ids[i]);
      break;
  }
  for (int i = 0; i < n; ++i) rt.fibers[ids[i]].state = State::kReady;
}

std::string fiber_state(const Fiber& f) {
  switch (f.state) {
    case State::kReady: return "ready";
    case State::kDone: return "exited";
    case State::kBarrier: return "at __syncthreads " + f.site.str();
    case State::kClusterBarrier: return "at cluster_sync " + f.site.str();
    case State::kMbarrier: return "at mbarrier_wait " + f.site.str() + " (parity " + std::to_string(f.parity) + ")";
    case State::kWarp: {
      std::ostringstream s;
      s << "at a warp intrinsic " << f.site.str() << " (mask 0x" << std::hex << f.mask << ")";
      return s.str();
    }
  }
  return "?";
}

// Completes block `rank`'s __syncthreads when every live thread of the block has arrived, and the cluster_sync when
// every live thread of the cluster has.
void try_release_barriers(int rank) {
  std::vector<int> ids;
  Block& b = rt.blocks[rank];
  if (b.barrier_count > 0 && b.barrier_count >= b.live) {
    const int first = rank * rt.threads_per_block;
    for (int i = first; i < first + rt.threads_per_block; ++i) {
      if (rt.fibers[i].state == State::kBarrier) ids.push_back(i);
    }
    b.barrier_count = 0;
    make_ready(ids.data(), static_cast<int>(ids.size()));
  }
  if (rt.cluster_count > 0 && rt.cluster_count >= rt.live) {
    for (auto& [address, m] : rt.mbarriers) m.visible = m.visible || m.fenced;
    ids.clear();
    for (Fiber& f : rt.fibers) {
      if (f.state == State::kClusterBarrier) ids.push_back(f.id);
    }
    rt.cluster_count = 0;
    make_ready(ids.data(), static_cast<int>(ids.size()));
  }
}

// The fiber of lane 0 of warp `warp` of the cluster (the lanes follow it).
Fiber* warp_lanes(int warp) {
  const int rank = warp / rt.warps_per_block, in_block = warp % rt.warps_per_block;
  return &rt.fibers[rank * rt.threads_per_block + in_block * 32];
}

// The lane whose value lane `lane` receives (itself when the shuffle leaves its segment).
int source_lane(const Fiber& f) {
  const int width = f.width, base = f.lane & ~(width - 1), in_segment = f.lane & (width - 1);
  switch (f.kind) {
    case WarpKind::kShflIdx: return base + (f.lane_arg & (width - 1));
    case WarpKind::kShflUp: return in_segment >= f.lane_arg ? f.lane - f.lane_arg : f.lane;
    case WarpKind::kShflDown: return in_segment + f.lane_arg < width ? f.lane + f.lane_arg : f.lane;
    case WarpKind::kShflXor: {
      const int src = f.lane ^ f.lane_arg;
      return src < base + width ? src : f.lane;  // a later segment: the lane's own value
    }
    default: return f.lane;
  }
}

// Completes warp `warp`'s intrinsic at index `k` when every live lane of its mask has arrived; returns whether it
// did. Reports a shuffle that reads a lane outside the participants.
bool try_complete_warp_op(int warp, size_t k) {
  const PendingWarpOp op = rt.warp_ops[warp][k];
  const unsigned needed = op.mask & rt.live_lanes[warp];
  if ((op.arrived & needed) != needed) return false;
  rt.warp_ops[warp].erase(rt.warp_ops[warp].begin() + static_cast<long>(k));
  Fiber* lanes = warp_lanes(warp);
  uint64_t ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if (op.arrived & (1u << l)) ballot |= static_cast<uint64_t>(lanes[l].value != 0) << l;
  }
  int ids[32], n = 0;
  for (int l = 0; l < 32; ++l) {
    if (!(op.arrived & (1u << l))) continue;
    Fiber& f = lanes[l];
    switch (op.kind) {
      case WarpKind::kSync: break;
      case WarpKind::kBallot: f.result = ballot; break;
      case WarpKind::kAny: f.result = ballot != 0; break;
      case WarpKind::kAll: f.result = ballot == (op.arrived & 0xffffffffull); break;
      default: {
        const int src = source_lane(f);
        if (src < 0 || src >= 32 || !(op.arrived & (1u << src))) {
          std::ostringstream s;
          s << "shuffle at " << op.site.str() << ": " << describe(f.coords) << " (lane " << l << ") reads lane " << src
            << ", which is " << (src >= 0 && src < 32 && (op.mask & (1u << src)) ? "not participating" : "outside")
            << " the mask 0x" << std::hex << op.mask << " (its value is undefined)";
          rt.error = s.str();
          return true;
        }
        f.result = lanes[src].value;
      }
    }
    ids[n++] = f.id;
  }
  make_ready(ids, n);
  return true;
}

void check_warp_ops(int warp) {
  for (size_t k = 0; k < rt.warp_ops[warp].size();) {
    if (!try_complete_warp_op(warp, k)) ++k;
  }
}

bool greedy() {
  return rt.schedule.order == Order::kGreedyHigh || rt.schedule.order == Order::kGreedyLow;
}

// Ends the current phase of mbarrier `bar` when its arrivals are made and its announced bytes have landed (and no
// more): the threads that wait for it run.
void try_complete_phase(const void* bar, MbarrierState& m) {
  if (m.pending > 0 || m.bytes != 0) return;
  const unsigned done = m.phase & 1u;
  ++m.phase;
  m.pending = m.arrivals;
  std::vector<int> ids;
  for (const Fiber& f : rt.fibers) {
    if (f.state == State::kMbarrier && f.bar == bar && f.parity == done) ids.push_back(f.id);
  }
  make_ready(ids.data(), static_cast<int>(ids.size()));
}

// The mbarrier at `bar` in block `block`'s shared memory; fails unless one was initialized there.
MbarrierState& mbarrier_at(const void* bar, int block, const char* what) {
  auto it = rt.mbarriers.find(bar);
  if (it == rt.mbarriers.end() || it->second.block != block) {
    fail_in_fiber(describe(rt.current->coords) + ": " + what + " on " +
                  (it == rt.mbarriers.end() ? "no" : "another block's") +
                  " mbarrier (mbarrier_init first, in the block's own shared memory)");
  }
  return it->second;
}

// Push `p` lands: its bytes at their place, counted on their mbarrier.
void land(const Push& p) {
  if (rt.blocks[p.block].live == 0) {
    std::ostringstream s;
    s << describe(rt.fibers[p.from].coords) << ": a cluster_push landed in block rank " << p.block
      << " after all of its threads exited (on a GPU its shared memory is gone)";
    if (rt.error.empty()) rt.error = s.str();
    return;
  }
  memcpy(p.to, p.value.data(), p.value.size());
  MbarrierState& m = rt.mbarriers.at(p.bar);
  m.bytes -= static_cast<long long>(p.value.size());
  try_complete_phase(p.bar, m);
}

// Lands the pushes of fiber `from` (every fiber's when from < 0), oldest first.
void land_pushes(int from) {
  std::deque<Push> keep;
  while (!rt.pushes.empty()) {
    Push p = std::move(rt.pushes.front());
    rt.pushes.pop_front();
    if (from < 0 || p.from == from) {
      land(p);
    } else {
      keep.push_back(std::move(p));
    }
  }
  rt.pushes = std::move(keep);
}

// Before fiber f waits or exits: under the greedy orders its pushes land now (the block that runs ahead overwrites
// what a slow one has not read yet); under the forward and reverse ones only when no thread can run (run_cluster: a
// read before the wait sees stale bytes).
void land_before_waiting(const Fiber& f) {
  if (greedy()) land_pushes(f.id);
}

// Block `rank` has exited: nothing may be in flight to it, and no phase of its mbarriers may have begun.
void check_exited_mbarriers(int rank) {
  for (const Push& p : rt.pushes) {
    if (p.block == rank) land(p);  // reports it
  }
  for (const auto& [bar, m] : rt.mbarriers) {
    if (m.block != rank || (m.pending == m.arrivals && m.bytes == 0)) continue;
    std::ostringstream s;
    s << "block rank " << rank << " exited with phase " << m.phase
      << " of its mbarrier begun: " << m.arrivals - m.pending << " of " << m.arrivals << " arrivals, "
      << (m.bytes >= 0 ? std::to_string(m.bytes) + " announced bytes not landed"
                       : std::to_string(-m.bytes) + " bytes landed that no arrival announced");
    if (rt.error.empty()) rt.error = s.str();
  }
}

void fiber_entry() {
  Fiber& f = *rt.current;
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &rt.scheduler_stack_bottom, &rt.scheduler_stack_size);
#endif
  try {
    f.async_copies.clear();
    if (!rt.aborting) rt.run_thread(rt.context);
    if (!rt.aborting) land_before_waiting(f);
    if (!f.async_copies.empty()) {
      fail_in_fiber(describe(f.coords) + ": ended with " + std::to_string(f.async_copies.size()) +
                    " async_copy_16 not waited for (async_copy_wait_all)");
    }
  } catch (const FiberAbort&) {
  }
  f.state = State::kDone;
  --rt.live;
  Block& block = rt.blocks[f.block];
  --block.live;
  rt.live_lanes[f.warp] &= ~(1u << f.lane);
  if (rt.aborting) {
    park(f);  // never resumed
    __builtin_unreachable();
  }
  if (block.barrier_count > 0) {
    std::ostringstream s;
    s << "divergent __syncthreads: " << describe(f.coords) << " exited while other threads of its block wait at "
      << block.barrier_site.str();
    if (rt.error.empty()) rt.error = s.str();
  }
  if (rt.cluster_count > 0) {
    std::ostringstream s;
    s << "divergent cluster_sync: " << describe(f.coords) << " exited while other threads of its cluster wait at "
      << rt.cluster_site.str();
    if (rt.error.empty()) rt.error = s.str();
  }
  check_warp_ops(f.warp);  // an exited lane no longer holds back its warp's intrinsics
  if (block.live == 0) {
    check_exited_mbarriers(f.block);
    block_exited(static_cast<unsigned>(f.block));  // its shared memory is gone
  }
  park(f);  // never resumed
  __builtin_unreachable();
}

// A new fiber's context: its first switch enters fiber_entry on its own stack.
[[gnu::noinline]] void init_context(Fiber& f) {
#if CUDA_EMU_ASAN
  // The stack's last fiber never unwound (a fiber ends by switching away): clear its frames' redzones.
  __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
#if CUDA_EMU_ASM_SWITCH
  // What cuda_emu_switch pops: the FP control words, six registers, then fiber_entry as the return address, at a
  // 16-byte aligned slot so that fiber_entry starts with the stack alignment of a called function.
  auto* top = reinterpret_cast<uint64_t*>(f.stack + kStackBytes);
  uint64_t* slot = top - 2;
  slot[1] = 0;  // fiber_entry's own return address: it never returns
  slot[0] = reinterpret_cast<uint64_t>(&fiber_entry);
  uint64_t* sp = slot - 7;
  for (int i = 1; i < 7; ++i) sp[i] = 0;
  const uint32_t mxcsr = 0x1f80;
  const uint16_t fpu_control = 0x037f;
  memcpy(sp, &mxcsr, sizeof(mxcsr));
  memcpy(reinterpret_cast<char*>(sp) + 4, &fpu_control, sizeof(fpu_control));
  f.context = sp;
#else
  // getcontext returns twice: here, away from run_block, it makes no caller's local suspect.
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, fiber_entry, 0);
#endif
}

// Runs the `blocks` blocks of one cluster, starting at `first` (block_idx of rank 0), all their threads together.
void run_cluster(const LaunchSpec& spec, const Coords& first, int blocks) {
  const int threads = rt.threads_per_block, warps = rt.warps_per_block, total = blocks * threads;
  rt.fibers.assign(total, Fiber{});
  rt.blocks.assign(blocks, Block{});
  rt.warp_ops.assign(blocks * warps, {});
  rt.live_lanes.assign(blocks * warps, 0);
  rt.ready.clear();
  rt.live = total;
  rt.cluster_count = 0;
  rt.mbarriers.clear();
  rt.pushes.clear();
  begin_cluster(spec, first.block_idx, static_cast<unsigned>(blocks));
  std::vector<int> ids(total);
  for (int rank = 0; rank < blocks; ++rank) {
    rt.blocks[rank].live = threads;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = rt.fibers[rank * threads + i];
      f.coords = first;
      f.coords.block_idx.x += rank;
      f.coords.thread_idx = {i % first.block_dim.x, (i / first.block_dim.x) % first.block_dim.y,
                             i / (first.block_dim.x * first.block_dim.y)};
      f.id = rank * threads + i;
      f.block = rank;
      f.warp = rank * warps + i / 32;
      f.lane = i % 32;
      f.stack = stack_for(f.id);
      rt.live_lanes[f.warp] |= 1u << f.lane;
      init_context(f);
      ids[f.id] = f.id;
    }
  }
  make_ready(ids.data(), total);
  while (rt.error.empty()) {
    if (rt.ready.empty()) {  // no thread can run: what is in flight lands now (the forward and reverse orders' only)
      if (rt.pushes.empty()) break;
      land_pushes(-1);
      continue;
    }
    const int id = rt.ready.front();
    rt.ready.pop_front();
    resume(rt.fibers[id]);
  }
  if (rt.error.empty() && rt.live > 0) {
    const uint3 b = first.block_idx;
    std::ostringstream s;
    if (blocks == 1) {
      s << "deadlock in block (" << b.x << "," << b.y << "," << b.z << "): no thread can run;";
    } else {
      s << "deadlock in the cluster of blocks (" << b.x << ".." << b.x + blocks - 1 << "," << b.y << "," << b.z
        << "): no thread can run;";
    }
    int shown = 0;
    for (const Fiber& f : rt.fibers) {
      if (f.state == State::kDone) continue;
      if (shown++ == 8) {
        s << " ...";
        break;
      }
      if (blocks > 1) s << " block " << f.coords.block_idx.x;
      s << " thread " << f.id % threads << " " << fiber_state(f) << ";";
    }
    rt.error = s.str();
  }
  if (!rt.error.empty()) {  // unwind every fiber that has not ended, so that its destructors run
    rt.aborting = true;
    for (Fiber& f : rt.fibers) {
      if (f.state != State::kDone) resume(f);
    }
    rt.aborting = false;
  }
  end_cluster();
  if (!rt.error.empty()) {
    std::string message =
        std::string(spec.kernel) + " (" + spec.file + ":" + std::to_string(spec.line) + "): " + rt.error;
    rt.error.clear();
    throw LaunchError(message);
  }
}

// The kernel's unqualified name, from the expression at its launch ("ns::name<T, Out>").
std::string kernel_name(const char* expression) {
  std::string name(expression, strcspn(expression, "<( "));
  const size_t colons = name.rfind("::");
  return colons == std::string::npos ? name : name.substr(colons + 2);
}

// "name(parameter types)", from the kernel expression and its function type.
std::string kernel_signature(const LaunchSpec& spec) {
  const std::string name = kernel_name(spec.kernel);
  int status = 0;
  char* demangled = abi::__cxa_demangle(spec.signature, nullptr, nullptr, &status);
  std::string type = status == 0 && demangled ? demangled : spec.signature;
  free(demangled);
  const size_t open = type.find("(*)(");  // "void (*)(float const*, ...)"
  return name + (open == std::string::npos ? "(" + type + ")" : type.substr(open + 3));
}

int launch_bound(const char* kernel) {
  const std::string name = kernel_name(kernel);
  for (const LaunchBound& b : kLaunchBounds) {
    if (name == b.kernel) return b.max_threads;
  }
  return kMaxThreads;
}

// Throws LaunchError for an invalid launch; returns what the device refuses ("": nothing), `refused` set then.
std::string check_launch(const LaunchSpec& spec, bool* refused) {
  const dim3 b = spec.block, g = spec.grid;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  std::ostringstream s;
  *refused = false;
  if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > kMaxThreads) {
    s << "invalid block (" << b.x << "," << b.y << "," << b.z << "): at most 1024 threads, x and y <= 1024, z <= 64";
  } else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    s << "invalid grid (" << g.x << "," << g.y << "," << g.z << ")";
  } else if (threads > static_cast<uint64_t>(launch_bound(spec.kernel))) {
    s << threads << " threads per block exceed the kernel's __launch_bounds__(" << launch_bound(spec.kernel)
      << "): the launch would fail (too many resources requested)";
  } else {
    s << check_cluster_and_shared(spec, refused);
  }
  const std::string problem = s.str();
  if (problem.empty()) return problem;
  const std::string message = std::string(spec.kernel) + " (" + spec.file + ":" + std::to_string(spec.line) + "): ";
  if (*refused) return message + "the device refuses the launch: " + problem;
  throw LaunchError(message + problem);
}

// The running thread arrives at a barrier (`name`: __syncthreads of its block or cluster_sync of its cluster, whose
// gathering site and count are `barrier_site` and `count`) and waits until it completes.
void arrive(const std::source_location& where, State state, const char* name, const char* scope, Site& barrier_site,
            int& count) {
  Fiber& f = *rt.current;
  land_before_waiting(f);
  const Site site = site_of(where);
  if (count == 0) {
    barrier_site = site;
  } else if (!(barrier_site == site)) {
    fail(std::string("divergent ") + name + ": this thread is at " + site.str() + " while others of its " + scope +
         " wait at " + barrier_site.str());
  }
  f.state = state;
  f.site = site;
  ++count;
  try_release_barriers(f.block);
  park(f);
}

}  // namespace

void set_schedule(const Schedule& s) {
  rt.schedule = s;
}

std::string take_launch_log() {
  std::string out;
  for (const auto& [name, count] : rt.launch_log) {
    out += (out.empty() ? "" : ";") + name + "#" + std::to_string(count);
  }
  rt.launch_log.clear();
  return out;
}

void async_copy_push(void* shared, const void* global) {
  if (rt.current == nullptr) throw LaunchError("async_copy_16 outside a kernel");
  if (reinterpret_cast<uintptr_t>(shared) % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0) {
    fail_in_fiber(describe(rt.current->coords) + ": async_copy_16 between addresses not both 16-byte aligned");
  }
  map_shared(shared, cluster_block_rank());  // fails unless `shared` is in this block's shared memory
  rt.current->async_copies.emplace_back(shared, global);
}

std::vector<std::pair<void*, const void*>> async_copy_take() {
  if (rt.current == nullptr) throw LaunchError("async_copy_wait_all outside a kernel");
  return std::exchange(rt.current->async_copies, {});
}

const Coords& coords() {
  if (rt.current == nullptr) throw LaunchError("threadIdx/blockIdx/blockDim/gridDim read outside a kernel");
  return rt.current->coords;
}

void fail(const std::string& message) {
  if (rt.current == nullptr) throw LaunchError(message);
  fail_in_fiber(describe(rt.current->coords) + ": " + message);
}

void device_assert_fail(const char* condition, const char* file, int line) {
  const char* base = strrchr(file, '/');
  fail(std::string("device assert failed: ") + condition + " (" + (base ? base + 1 : file) + ":" +
       std::to_string(line) + ")");
}

void syncthreads(const std::source_location& where) {
  Block& b = rt.blocks[rt.current->block];
  arrive(where, State::kBarrier, "__syncthreads", "block", b.barrier_site, b.barrier_count);
}

// The mbarriers the running thread initialized become the cluster's at the next cluster barrier (cluster_sync's
// release, or cluster_sync_mbarrier_init's fence.mbarrier_init).
void fence_mbarrier_inits() {
  for (auto& [bar, m] : rt.mbarriers) m.fenced = m.fenced || m.initializer == rt.current->id;
}

void cluster_sync(const std::source_location& where) {
  if (rt.current == nullptr) throw LaunchError("cluster_sync outside a kernel");
  fence_mbarrier_inits();
  arrive(where, State::kClusterBarrier, "cluster_sync", "cluster", rt.cluster_site, rt.cluster_count);
}

void mbarrier_init(void* bar, unsigned arrivals) {
  if (rt.current == nullptr) throw LaunchError("mbarrier_init outside a kernel");
  map_shared(bar, cluster_block_rank());  // fails unless `bar` is in this block's shared memory
  if (reinterpret_cast<uintptr_t>(bar) % 8 != 0) fail("mbarrier_init at an address not 8-byte aligned");
  if (arrivals == 0) fail("mbarrier_init with 0 arrivals a phase");
  if (rt.mbarriers.count(bar) > 0) fail("mbarrier_init twice on one mbarrier");
  MbarrierState m;
  m.block = rt.current->block;
  m.arrivals = m.pending = static_cast<int>(arrivals);
  m.initializer = rt.current->id;
  rt.mbarriers.emplace(bar, m);
}

void cluster_sync_mbarrier_init(const std::source_location& where) {
  if (rt.current == nullptr) throw LaunchError("cluster_sync_mbarrier_init outside a kernel");
  fence_mbarrier_inits();
  arrive(where, State::kClusterBarrier, "cluster_sync_mbarrier_init", "cluster", rt.cluster_site, rt.cluster_count);
}

void mbarrier_arrive_expect_tx(void* bar, unsigned bytes) {
  if (rt.current == nullptr) throw LaunchError("mbarrier_arrive_expect_tx outside a kernel");
  MbarrierState& m = mbarrier_at(bar, rt.current->block, "mbarrier_arrive_expect_tx");
  if (m.pending == 0) fail("mbarrier_arrive_expect_tx on a phase that has all of its arrivals");
  --m.pending;
  m.bytes += bytes;
  try_complete_phase(bar, m);
}

void cluster_push(void* slot, unsigned rank, const void* value, size_t bytes, void* bar) {
  if (rt.current == nullptr) throw LaunchError("cluster_push outside a kernel");
  if (rt.blocks.size() == 1) {  // Triton's verifier refuses it too (triton-lang/triton PR 10357)
    fail(
        "cluster_push in a launch without a cluster of at least 2 blocks: PTX leaves st.async into a one-block "
        "cluster's own shared memory undefined");
  }
  void* to = map_shared(slot, rank);  // fails unless slot is this block's shared memory and block `rank` is live
  const void* at = map_shared(bar, rank);
  if (reinterpret_cast<uintptr_t>(to) % 16 != 0) fail("cluster_push to an address not 16-byte aligned");
  const MbarrierState& m = mbarrier_at(at, static_cast<int>(rank), "cluster_push");
  if (static_cast<int>(rank) != rt.current->block && !m.visible) {
    fail("cluster_push to the mbarrier of block rank " + std::to_string(rank) +
         " before a cluster barrier followed its initialization (cluster_sync_mbarrier_init): on a GPU it may not "
         "be initialized yet");
  }
  const auto* bytes_of = static_cast<const unsigned char*>(value);
  rt.pushes.push_back({rt.current->id, static_cast<int>(rank), to, at, {bytes_of, bytes_of + bytes}});
}

void mbarrier_wait(void* bar, unsigned parity, const std::source_location& where) {
  if (rt.current == nullptr) throw LaunchError("mbarrier_wait outside a kernel");
  Fiber& f = *rt.current;
  mbarrier_at(bar, f.block, "mbarrier_wait");
  land_before_waiting(f);
  if ((rt.mbarriers.at(bar).phase & 1u) != (parity & 1u)) return;  // that phase has completed
  f.state = State::kMbarrier;
  f.site = site_of(where);
  f.bar = bar;
  f.parity = parity & 1u;
  park(f);
}

unsigned cluster_block_rank() {
  return running_block_rank();
}

unsigned cluster_num_blocks() {
  if (rt.current == nullptr) throw LaunchError("cluster_num_blocks outside a kernel");
  return static_cast<unsigned>(rt.blocks.size());
}

unsigned running_block_rank() {
  if (rt.current == nullptr) throw LaunchError("a cluster or shared-memory function used outside a kernel");
  return static_cast<unsigned>(rt.current->block);
}

const Coords* running_coords() {
  return rt.current == nullptr ? nullptr : &rt.current->coords;
}

uint64_t warp_op(WarpKind kind, unsigned mask, uint64_t value, int lane_arg, int width,
                 const std::source_location& where) {
  Fiber& f = *rt.current;
  land_before_waiting(f);
  const Site site = site_of(where);
  if (!(mask & (1u << f.lane))) {
    fail("lane " + std::to_string(f.lane) + " calls a warp intrinsic at " + site.str() + " with a mask (" + hex(mask) +
         ") that does not name it");
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) fail("shuffle width " + std::to_string(width));
  std::vector<PendingWarpOp>& ops = rt.warp_ops[f.warp];
  size_t k = 0;
  for (; k < ops.size(); ++k) {
    if (!(ops[k].mask & mask)) continue;
    if (ops[k].mask != mask || ops[k].kind != kind || ops[k].width != width || !(ops[k].site == site)) {
      fail("divergent warp intrinsics: lane " + std::to_string(f.lane) + " is at " + site.str() + " (mask " +
           hex(mask) + ") while lanes of its warp wait at " + ops[k].site.str() + " (mask " + hex(ops[k].mask) + ")");
    }
    break;
  }
  if (k == ops.size()) ops.push_back({mask, kind, width, site, 0});
  ops[k].arrived |= 1u << f.lane;
  f.state = State::kWarp;
  f.site = site;
  f.kind = kind;
  f.mask = mask;
  f.lane_arg = lane_arg;
  f.width = width;
  f.value = value;
  try_complete_warp_op(f.warp, k);
  park(f);
  return f.result;
}

cudaError_t run_grid(const LaunchSpec& spec, void (*run_thread)(void*), void* context) {
  bool refused = false;
  const std::string refusal = check_launch(spec, &refused);
  if (refused) {
    if (!spec.returns_refusal) throw LaunchError(refusal);
    set_pending_error(cudaErrorInvalidValue, refusal);
    return cudaErrorInvalidValue;
  }
  // <<<blocks, threads per block>>> (x)
  ++rt.launch_log[kernel_signature(spec) + "<<<" + std::to_string(spec.grid.x) + "," + std::to_string(spec.block.x) +
                  ">>>"];
  // The grid cap keeps grid.x a multiple of the cluster size (at least one cluster).
  const unsigned cap = rt.schedule.grid_cap, n = spec.cluster_blocks;
  const unsigned cap_x = cap / n * n > n ? cap / n * n : n;
  const dim3 grid(cap && spec.grid.x > cap_x ? cap_x : spec.grid.x, cap && spec.grid.y > cap ? cap : spec.grid.y,
                  cap && spec.grid.z > cap ? cap : spec.grid.z);
  rt.threads_per_block = static_cast<int>(spec.block.x * spec.block.y * spec.block.z);
  rt.warps_per_block = (rt.threads_per_block + 31) / 32;
  rt.run_thread = run_thread;
  rt.context = context;
  traffic_begin(spec.kernel);
  struct TrafficEnd {
    ~TrafficEnd() { traffic_end(); }
  } end_traffic;  // also when a launch fails
  const unsigned clusters_x = grid.x / n;
  const uint64_t clusters = uint64_t(clusters_x) * grid.y * grid.z;
  for (uint64_t k = 0; k < clusters; ++k) {
    const bool descending = rt.schedule.order == Order::kReverse || rt.schedule.order == Order::kGreedyHigh;
    const uint64_t id = descending ? clusters - 1 - k : k;
    Coords c;
    c.block_idx = {static_cast<unsigned>(id % clusters_x) * n, static_cast<unsigned>((id / clusters_x) % grid.y),
                   static_cast<unsigned>(id / (uint64_t(clusters_x) * grid.y))};
    c.block_dim = spec.block;
    c.grid_dim = grid;
    run_cluster(spec, c, static_cast<int>(n));
  }
  return cudaSuccess;
}

cudaError_t max_active_clusters(const LaunchSpec& spec, int* active) {
  bool refused = false;
  check_launch(spec, &refused);  // throws for an invalid launch
  *active = 0;
  if (refused) return cudaSuccess;  // the device cannot run one such cluster
  const DeviceLimits& d = device_limits();
  constexpr size_t kReservedPerBlock = 1024, kThreadsPerSm = 2048;
  const size_t threads = size_t(spec.block.x) * spec.block.y * spec.block.z;
  const size_t by_shared = d.shared_per_sm / (spec.shared_bytes + kReservedPerBlock);
  const size_t by_threads = kThreadsPerSm / threads;
  const size_t per_sm = by_shared < by_threads ? by_shared : by_threads;
  const size_t per_gpc = per_sm * d.gpc_sms / spec.cluster_blocks;  // clusters one GPC holds
  *active = static_cast<int>(per_gpc * d.gpcs);
  return cudaSuccess;
}

}  // namespace cuda_emu
