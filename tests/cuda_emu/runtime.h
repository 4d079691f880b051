// cuda_emu: runs grpo_ext's CUDA kernel headers (csrc/cuda/*.cuh) on the CPU, under g++ with AddressSanitizer and
// UBSan, so that every CI run executes every kernel. This header is what the kernels see; runtime.cpp holds the
// scheduler, shared_memory.cpp the shared memory, the clusters' launch checks and the emulated device's limits.
// (Over 300 lines: the emulation's contract, below, is written once, here, beside every CUDA name the kernels use.)
//
// What it emulates
// - Each CUDA thread is a user-space fiber (ucontext, a 64 KiB stack with a guard page). The blocks of a grid run
//   one after another (a cluster's blocks together, below); the threads of a block run on one OS thread and switch
//   only at a synchronization point. threadIdx, blockIdx, blockDim and gridDim are the running fiber's.
// - __shared__ variables: one fresh heap allocation per block (ASan sees an access past their end), filled with
//   0xff bytes (NaN in every float type), so a read before the block wrote them shows. tests/cuda_emu/build.py
//   turns each `__shared__ T x[N];` of a copy of the headers into a reference to that storage, on the same line;
//   nothing else of the headers is changed. At most 48 KiB per block (the static shared-memory limit).
// - Dynamic shared memory (grpo_ext::dynamic_shared<T>(), csrc/cuda/cluster.cuh): the launch's `shared_bytes`, per
//   block one fresh 16-byte aligned heap allocation of exactly that size, 0xff-filled, its end visible to ASan.
//   As on a GPU, a kernel may use at most 48 KiB of static plus dynamic shared memory unless GRPO_ALLOW_DYNAMIC_SHARED
//   set its maximum dynamic size (then at most that much dynamic, and that much plus its static shared memory at most
//   the device's limit); the allowance is per kernel instantiation and lasts for the process (cudaFuncSetAttribute).
//   Static plus dynamic shared memory must fit the device's max shared memory per block (DeviceLimits). The static
//   part is known only when the kernel declares its variables, so exceeding a limit with it fails the launch there.
// - Thread-block clusters (GRPO_LAUNCH_CLUSTER, sm_90): `cluster_blocks` consecutive blocks along x, blockIdx.x / n
//   the cluster and blockIdx.x % n the rank. All the threads of a cluster's blocks are fibers of one scheduler pass;
//   the clusters run one after another. grpo_ext::cluster_sync() parks a thread until every live thread of every
//   block of the cluster has arrived at the same call site (another site, or exiting while others wait: a divergent
//   barrier); __syncthreads() stays per block (a separate barrier: mixing the two deadlocks, as on a GPU).
//   cluster_map_shared(p, rank): p must point into the calling block's shared memory (a __shared__ variable or the
//   dynamic shared memory), rank must be below the cluster size; it returns the same offset in block `rank`'s
//   storage. Every block's storage lives until its cluster ends, but when a block's last thread exits its storage is
//   poisoned for ASan (on a GPU the block's shared memory is gone): a peer that reads or writes it afterwards (a
//   missing cluster_sync before exit) is reported, and so is cluster_map_shared onto an exited block.
//   An ordinary launch is a cluster of one block: cluster_block_rank() 0, cluster_num_blocks() 1, cluster_sync() a
//   barrier of the block.
// - mbarriers and pushes (cluster.cuh): mbarrier_init (in the calling block's shared memory, 8-byte aligned, once),
//   mbarrier_arrive_expect_tx (an arrival of the current phase, and the bytes it announces), cluster_push (st.async:
//   a copy of the value is queued, to land at the same offset in block `rank` and count its bytes on that block's
//   mbarrier), mbarrier_wait (parks until the phase of that parity completes: every arrival made and the announced
//   bytes landed, none more). Under the forward and reverse orders a push lands only when no thread can run, so that
//   a read of the slot before the wait sees what was there before; under the greedy orders it lands when its thread
//   next waits or exits, so that the block that runs ahead overwrites what a slow peer has not read yet. Reported: a
//   push to a peer's mbarrier before a cluster barrier followed that mbarrier's initialization
//   (cluster_sync_mbarrier_init, or cluster_sync), an arrival at a phase that has all of its, a push into a block that
//   has exited, and a block that exits with a phase of one of its mbarriers begun (arrivals or bytes outstanding, or
//   bytes landed that no arrival announced), and a push in a launch of one-block clusters (st.async to the block's
//   own shared memory, undefined in PTX for a one-block cluster).
// - __syncthreads() parks a thread until every thread of the block has arrived at the same call site (file, line,
//   column). Arriving at another site, or exiting while others wait, is reported as a divergent barrier.
// - __shfl_sync/_up/_down/_xor, __syncwarp, __ballot_sync, __any_sync, __all_sync wait for every live lane named
//   in the mask, at the same call site with the same mask. Reported: a lane not in its own mask, lanes of a mask at
//   different sites, overlapping different masks, and a shuffle reading a lane that is outside the mask, absent or
//   exited (its value would be undefined on a GPU).
// - A block (a cluster) in which no thread can run and some wait is reported as a deadlock, with where each thread
//   waits.
// - Launch checks: block dimensions (x, y <= 1024, z <= 64, at most 1024 threads), grid dimensions (x < 2^31,
//   y, z <= 65535), the kernel's __launch_bounds__ (build.py reads them from the headers), the dynamic shared memory
//   against its allowance, cluster_blocks >= 1 and grid.x a multiple of it, at most 16, and at most 8 unless
//   GRPO_ALLOW_NONPORTABLE_CLUSTER allowed the kernel more (per kernel instantiation, for the process): a LaunchError.
//   What a GPU refuses at launch time because of the device's limits (cluster_blocks over
//   DeviceLimits::max_cluster_blocks, or max_nonportable_cluster_blocks for an allowed kernel, dynamic shared
//   memory over max_shared_per_block) is a LaunchError for GRPO_LAUNCH, but GRPO_LAUNCH_CLUSTER returns
//   cudaErrorInvalidValue (and so does GRPO_ALLOW_DYNAMIC_SHARED over the device's limit), so that the launcher can
//   fall back. As in the CUDA runtime, the error also stays pending until cudaGetLastError() takes it: an op that
//   leaves one pending fails (its binding's C10_CUDA_KERNEL_LAUNCH_CHECK would throw it).
// - The emulated device (DeviceLimits, default an H100: 232448 bytes of shared memory per block, 233472 per SM,
//   clusters of up to 8 blocks, 16 non-portable) is set by the driver's --shared-per-block, --max-cluster,
//   --max-nonportable-cluster, --shared-per-sm and --gpc-sms (client.EmuDevice's arguments of those names); the ops'
//   code reads it with device_limits() to pick a path, as the bindings query the GPU.
// - GRPO_MAX_ACTIVE_CLUSTERS (cudaOccupancyMaxActiveClusters): the launch checked as above (a LaunchError for what
//   is invalid, 0 clusters for what the device refuses), then the blocks per SM that its shared memory (dynamic plus
//   1 KiB reserved; the kernel's static shared memory is not known before it runs) and 2048 threads allow; a cluster
//   that needs more than gpc_sms such SMs gives 0 clusters, else gpcs x the clusters one GPC holds.
// - CUDA_KERNEL_ASSERT fails the launch with the condition, the block and the thread.
// - Schedules (Schedule below): the order in which ready threads run, the order of the blocks (clusters), and a cap
//   on the grid size, so that every grid-stride loop wraps (grid.x is capped to a multiple of the cluster size, at
//   least one cluster). Forward and reverse take turns in thread order (the warps progress together; the blocks of a
//   cluster in rank order); the greedy orders run a thread released from a barrier or warp intrinsic at once, so that
//   one warp runs ahead of the others as far as it can: the highest warp (it overwrites what warp 0 has not read
//   yet) or warp 0 (it overwrites what the others have not read yet). A correct kernel gives bit-identical results
//   under every schedule; the test driver checks that.
// - Device memory: the driver allocates each tensor as one heap block of exactly its size (ASan redzones on both
//   sides); fresh outputs are filled with 0xff bytes. __nv_bfloat16 and __half (include/) convert with
//   round-to-nearest-even, as __float2bfloat16_rn and __float2half_rn do.
//
// What it cannot show (only a GPU run can)
// - nvcc's code generation: FMA contraction, fast-math intrinsics, the device math library's last-ulp results.
// - Register pressure, spills, occupancy, and whether a launch fits the SM's registers (launch_bounds is checked
//   only against the block size), or how a real GPC takes a cluster (GRPO_MAX_ACTIVE_CLUSTERS is a model of it).
// - Memory ordering and real races: threads run one at a time, so a race shows only when some schedule makes it
//   change a result; atomics are plain read-modify-writes.
// - Timing, bandwidth, and anything about streams: launches run to completion, in order, when they are made.
// - Divergence between call sites inside a helper called from two places (a site is where the intrinsic is
//   written, not the call stack that reached it).
#pragma once

#include <math.h>  // float overloads of exp, log, ... in the global namespace, as CUDA's math headers declare them

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

// Device code takes its device paths (fast_math.h: the library exp/expm1, as on the GPU).
#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// build.py rewrites every __shared__ declaration; one left over is a compile error.
#define __shared__ __shared___must_be_rewritten_by_tests_cuda_emu_build_py

// __expf: on the GPU the SFU's exp2 of x * log2(e), subnormal results flushed to 0; here exp2f of the same
// product, flushed alike (its last ulp may differ from the SFU's).
inline float __expf(float x) {
  const float r = exp2f(x * 1.44269504088896341f);
  return (r > 0.0f && r < 1.17549435e-38f) ? 0.0f : r;
}

// Products rounded once (nvcc never fuses them into an FMA); the harness's g++ build contracts nothing anyway.
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
// Loads through L2 only (past a stale L1): plain loads here, where every access sees memory as it is.
template <typename T>
T __ldcg(const T* p) {
  return *p;
}

struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = struct CUstream_st*;
constexpr int warpSize = 32;

// The CUDA runtime's error codes, those the harness returns.
enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
using cudaError_t = cudaError;
// The error of the last refused launch or attribute setting, which it clears (cudaPeekAtLastError leaves it).
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
// Launches run to completion when they are made, so a memset on a stream is done at once.
inline cudaError_t cudaMemsetAsync(void* device_ptr, int value, size_t bytes, cudaStream_t /*stream*/) {
  memset(device_ptr, value, bytes);
  return cudaSuccess;
}

namespace cuda_emu {

// Why a launch failed (a kernel bug the harness detected, or an invalid launch); the driver reports it.
struct LaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Order { kForward, kReverse, kGreedyHigh, kGreedyLow };

// How the next launches run: the thread order, and at most `grid_cap` blocks in each grid dimension (0: the
// launcher's grid). Blocks run in ascending order, descending under kReverse and kGreedyHigh.
struct Schedule {
  Order order = Order::kForward;
  unsigned grid_cap = 0;
};
void set_schedule(const Schedule& s);

// The emulated device's limits (default an H100's), read by the launch checks and by the ops' code to pick a path.
struct DeviceLimits {
  size_t max_shared_per_block = 232448;          // static + dynamic, bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)
  unsigned max_cluster_blocks = 8;               // the portable cluster size limit
  unsigned max_nonportable_cluster_blocks = 16;  // with GRPO_ALLOW_NONPORTABLE_CLUSTER (at most 16 on any GPU)
  size_t shared_per_sm = 233472;  // bytes (cudaDevAttrMaxSharedMemoryPerMultiprocessor), 1 KiB reserved per block
  unsigned gpc_sms = 16;          // the SMs one cluster may span (a GPC), for GRPO_MAX_ACTIVE_CLUSTERS
  unsigned gpcs = 8;
};
const DeviceLimits& device_limits();
void set_device_limits(const DeviceLimits& limits);

// The refused launch or attribute setting whose error is still pending (cudaGetLastError did not take it), and
// clears it; empty when none.
std::string take_pending_error();

// The kernels launched since the last call, with their parameter types and launch counts:
// "name(types)#count;...".
std::string take_launch_log();

// Global-memory traffic (traffic.cpp; counted only in the traffic build): the driver registers each tensor's
// storage under a label ("arg<i>": the op's argument i, "new<k>": the k-th tensor the op allocated). The launches
// since the last call, tab-separated: "kernel|label:bytes read:distinct bytes read:bytes written|...".
void register_buffer(const void* base, size_t bytes, const std::string& label);
void forget_buffer(const void* base);
void traffic_begin(const char* kernel);
void traffic_end();
std::string take_traffic_log();

struct Coords {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
const Coords& coords();  // the running thread's; fails outside a kernel

[[noreturn]] void fail(const std::string& message);  // fails the running launch (from inside a kernel)
[[noreturn]] void device_assert_fail(const char* condition, const char* file, int line);

// Per-block storage of the __shared__ variable declared at `site` (build.py's rewrite calls this).
void* shared_storage(const char* site, size_t bytes, size_t align);
template <typename A>
A& shared(const char* site) {
  static_assert(std::is_trivially_copyable_v<A>, "a __shared__ variable must be trivially copyable");
  return *static_cast<A*>(shared_storage(site, sizeof(A), alignof(A)));
}

// The calling block's dynamic shared memory (the launch's shared_bytes).
void* dynamic_shared_storage();
// The address at p's offset in the shared memory of block `rank` of the calling block's cluster.
void* map_shared(const void* p, unsigned rank);
// GRPO_ALLOW_DYNAMIC_SHARED: `kernel` may launch with up to `bytes` of dynamic shared memory.
cudaError_t allow_dynamic_shared(const void* kernel, long long bytes, const char* name, const char* file, int line);
// cp.async (csrc/cuda/cluster.cuh's async_copy_16): each copy is queued on the calling thread (both addresses 16-byte
// aligned, the destination in its block's shared memory) and made at that thread's async_copy_wait_all, so that a
// read of the destination before the wait sees what was there before, as it may on a GPU; a thread that ends with
// copies still queued fails the launch.
void async_copy_push(void* shared, const void* global);
std::vector<std::pair<void*, const void*>> async_copy_take();
// GRPO_ALLOW_NONPORTABLE_CLUSTER: `kernel` may launch with clusters of up to 16 blocks.
cudaError_t allow_nonportable_cluster(const void* kernel);

void syncthreads(const std::source_location& site);
void cluster_sync(const std::source_location& site);
// csrc/cuda/cluster.cuh's mbarriers and pushes (runtime.h's top comment says what they check).
void mbarrier_init(void* bar, unsigned arrivals);
void cluster_sync_mbarrier_init(const std::source_location& site);
void mbarrier_arrive_expect_tx(void* bar, unsigned bytes);
void cluster_push(void* slot, unsigned rank, const void* value, size_t bytes, void* bar);
void mbarrier_wait(void* bar, unsigned parity, const std::source_location& site);
unsigned cluster_block_rank();
unsigned cluster_num_blocks();

enum class WarpKind { kSync, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };
// One lane's part in a warp-level intrinsic: its mask, 8 bytes of value, the lane argument and the width. Returns
// the 8 bytes the intrinsic hands this lane.
uint64_t warp_op(WarpKind kind, unsigned mask, uint64_t value, int lane_arg, int width,
                 const std::source_location& site);

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp intrinsics take values of at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T v;
  memcpy(&v, &bits, sizeof(T));
  return v;
}

// A grid of `run_thread(context)` calls, one per thread of every block.
struct LaunchSpec {
  const char* kernel;     // the kernel expression as written at the launch ("name<T, Out>")
  const char* signature;  // typeid(kernel).name(): which instantiation
  dim3 grid, block;
  size_t shared_bytes;  // dynamic
  cudaStream_t stream;
  const char* file;
  int line;
  unsigned cluster_blocks;  // 1: an ordinary launch
  bool returns_refusal;     // a launch the device's limits refuse returns cudaErrorInvalidValue instead of throwing
  const void* function;     // the kernel instantiation (its dynamic shared memory allowance)
};
// Runs the grid; returns cudaSuccess, or the refusal of a launch with returns_refusal. Throws LaunchError.
cudaError_t run_grid(const LaunchSpec& spec, void (*run_thread)(void*), void* context);
// GRPO_MAX_ACTIVE_CLUSTERS: how many clusters of `spec` the device runs at once, into *active (0: a cluster's blocks
// do not fit gpc_sms SMs' shared memory and threads, or the cluster is over the device's limit). Throws LaunchError
// for what is invalid at launch (as run_grid).
cudaError_t max_active_clusters(const LaunchSpec& spec, int* active);

// kernel<<<grid, block, shared_bytes, stream>>>(args...): the arguments are converted to the kernel's parameter
// types once, as a launch copies them, and every thread calls the kernel with its own copy.
template <typename... P>
class KernelLaunch {
 public:
  KernelLaunch(void (*kernel)(P...), LaunchSpec spec) : kernel_(kernel), spec_(spec) {
    spec_.signature = typeid(kernel).name();
    spec_.function = reinterpret_cast<const void*>(kernel);
  }

  template <typename... A>
  cudaError_t operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "a kernel launch with the wrong number of arguments");
    struct Context {
      void (*kernel)(P...);
      std::tuple<std::decay_t<P>...> params;
    } context{kernel_, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    return run_grid(
        spec_,
        [](void* c) {
          auto* ctx = static_cast<Context*>(c);
          std::apply(ctx->kernel, ctx->params);  // by-value parameters: each thread its own copy
        },
        &context);
  }

 private:
  void (*kernel_)(P...);
  LaunchSpec spec_;
};

}  // namespace cuda_emu

// The launch macros of csrc/cuda/launch.cuh, defined here first. GRPO_LAUNCH throws (LaunchError) on any launch
// failure; GRPO_LAUNCH_CLUSTER returns what a GPU refuses at launch time (runtime.h's top comment).
#define GRPO_LAUNCH(grid, block, shared_bytes, stream, ...)                                                          \
  ::cuda_emu::KernelLaunch(&__VA_ARGS__, ::cuda_emu::LaunchSpec{#__VA_ARGS__, nullptr, ::dim3(grid), ::dim3(block),  \
                                                                static_cast<size_t>(shared_bytes), stream, __FILE__, \
                                                                __LINE__, 1u, false, nullptr})
#define GRPO_LAUNCH_CLUSTER(grid, block, cluster_blocks, shared_bytes, stream, ...)                                 \
  ::cuda_emu::KernelLaunch(                                                                                         \
      &__VA_ARGS__,                                                                                                 \
      ::cuda_emu::LaunchSpec{#__VA_ARGS__, nullptr, ::dim3(grid), ::dim3(block), static_cast<size_t>(shared_bytes), \
                             stream, __FILE__, __LINE__, static_cast<unsigned>(cluster_blocks), true, nullptr})
#define GRPO_ALLOW_NONPORTABLE_CLUSTER(...) \
  ::cuda_emu::allow_nonportable_cluster(reinterpret_cast<const void*>(&__VA_ARGS__))
#define GRPO_MAX_ACTIVE_CLUSTERS(active, grid, block, cluster_blocks, shared_bytes, stream, ...)                    \
  ::cuda_emu::max_active_clusters(                                                                                  \
      ::cuda_emu::LaunchSpec{#__VA_ARGS__, nullptr, ::dim3(grid), ::dim3(block), static_cast<size_t>(shared_bytes), \
                             stream, __FILE__, __LINE__, static_cast<unsigned>(cluster_blocks), true,               \
                             reinterpret_cast<const void*>(&__VA_ARGS__)},                                          \
      active)
#define GRPO_ALLOW_DYNAMIC_SHARED(bytes, ...)                                                                  \
  ::cuda_emu::allow_dynamic_shared(reinterpret_cast<const void*>(&__VA_ARGS__), static_cast<long long>(bytes), \
                                   #__VA_ARGS__, __FILE__, __LINE__)
// csrc/cuda/cluster.cuh: the harness's versions of its functions are below.
#define GRPO_CLUSTER_API 1

#define CUDA_KERNEL_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : ::cuda_emu::device_assert_fail(#cond, __FILE__, __LINE__))

#define threadIdx (::cuda_emu::coords().thread_idx)
#define blockIdx (::cuda_emu::coords().block_idx)
#define blockDim (::cuda_emu::coords().block_dim)
#define gridDim (::cuda_emu::coords().grid_dim)

inline void __syncthreads(const std::source_location& site = std::source_location::current()) {
  ::cuda_emu::syncthreads(site);
}

// csrc/cuda/cluster.cuh's functions (runtime.h's top comment says what they check).
namespace grpo_ext {
inline unsigned cluster_block_rank() {
  return ::cuda_emu::cluster_block_rank();
}
inline unsigned cluster_num_blocks() {
  return ::cuda_emu::cluster_num_blocks();
}
inline void cluster_sync(const std::source_location& site = std::source_location::current()) {
  ::cuda_emu::cluster_sync(site);
}
template <typename T>
T* cluster_map_shared(T* p, unsigned rank) {
  return static_cast<T*>(::cuda_emu::map_shared(p, rank));
}
template <typename T>
T* dynamic_shared() {
  return static_cast<T*>(::cuda_emu::dynamic_shared_storage());
}
using Mbarrier = uint64_t;
inline void mbarrier_init(Mbarrier* bar, unsigned arrivals) {
  ::cuda_emu::mbarrier_init(bar, arrivals);
}
inline void cluster_sync_mbarrier_init(const std::source_location& site = std::source_location::current()) {
  ::cuda_emu::cluster_sync_mbarrier_init(site);
}
inline void mbarrier_arrive_expect_tx(Mbarrier* bar, unsigned bytes) {
  ::cuda_emu::mbarrier_arrive_expect_tx(bar, bytes);
}
template <typename V>
void cluster_push(V* slot, unsigned rank, const V& value, Mbarrier* bar) {
  static_assert(sizeof(V) % 16 == 0 && alignof(V) >= 16, "cluster_push moves 16-byte aligned pieces");
  static_assert(std::is_trivially_copyable_v<V>, "cluster_push copies bytes");
  ::cuda_emu::cluster_push(slot, rank, &value, sizeof(V), bar);
}
inline void mbarrier_wait(Mbarrier* bar, unsigned parity,
                          const std::source_location& site = std::source_location::current()) {
  ::cuda_emu::mbarrier_wait(bar, parity, site);
}
inline void async_copy_16(void* shared, const void* global) {
  ::cuda_emu::async_copy_push(shared, global);
}
inline void async_copy_wait_all() {
  for (const auto& [to, from] : ::cuda_emu::async_copy_take()) {
    // Copied here, in the kernel's translation unit, so that the traffic build counts the 16 bytes read from global
    // memory as the kernel's (and ASan checks them).
    const uint64_t* source = static_cast<const uint64_t*>(from);
    uint64_t* target = static_cast<uint64_t*>(to);
    target[0] = source[0];
    target[1] = source[1];
  }
}
}  // namespace grpo_ext
// Threads switch only at a synchronization point, so a plain read-modify-write is atomic here.
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
// Threads run one at a time: every write is visible to every later read, so a fence has nothing to order.
inline void __threadfence() {}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       const std::source_location& site = std::source_location::current()) {
  ::cuda_emu::warp_op(::cuda_emu::WarpKind::kSync, mask, 0, 0, warpSize, site);
}
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              const std::source_location& site = std::source_location::current()) {
  using ::cuda_emu::from_bits, ::cuda_emu::to_bits;
  return from_bits<T>(::cuda_emu::warp_op(::cuda_emu::WarpKind::kShflIdx, mask, to_bits(var), src_lane, width, site));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 const std::source_location& site = std::source_location::current()) {
  using ::cuda_emu::from_bits, ::cuda_emu::to_bits;
  return from_bits<T>(
      ::cuda_emu::warp_op(::cuda_emu::WarpKind::kShflUp, mask, to_bits(var), static_cast<int>(delta), width, site));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   const std::source_location& site = std::source_location::current()) {
  using ::cuda_emu::from_bits, ::cuda_emu::to_bits;
  return from_bits<T>(
      ::cuda_emu::warp_op(::cuda_emu::WarpKind::kShflDown, mask, to_bits(var), static_cast<int>(delta), width, site));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  const std::source_location& site = std::source_location::current()) {
  using ::cuda_emu::from_bits, ::cuda_emu::to_bits;
  return from_bits<T>(::cuda_emu::warp_op(::cuda_emu::WarpKind::kShflXor, mask, to_bits(var), lane_mask, width, site));
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              const std::source_location& site = std::source_location::current()) {
  return static_cast<unsigned>(
      ::cuda_emu::warp_op(::cuda_emu::WarpKind::kBallot, mask, predicate != 0, 0, warpSize, site));
}
inline int __any_sync(unsigned mask, int predicate,
                      const std::source_location& site = std::source_location::current()) {
  return static_cast<int>(::cuda_emu::warp_op(::cuda_emu::WarpKind::kAny, mask, predicate != 0, 0, warpSize, site));
}
inline int __all_sync(unsigned mask, int predicate,
                      const std::source_location& site = std::source_location::current()) {
  return static_cast<int>(::cuda_emu::warp_op(::cuda_emu::WarpKind::kAll, mask, predicate != 0, 0, warpSize, site));
}
