// cuda_emu's shared memory: each block's __shared__ variables and dynamic shared memory, distributed shared memory
// between the blocks of a cluster (cluster_map_shared), the kernels' dynamic shared memory allowances, the emulated
// device's limits and the launch checks against them, and the CUDA runtime's pending error (runtime.h's top comment
// says what is emulated).
#include "shared_memory.h"

#include <cstdio>
#include <map>
#include <new>
#include <sstream>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

namespace cuda_emu {
namespace {

// At most this much static shared memory, and static plus dynamic without a GRPO_ALLOW_DYNAMIC_SHARED allowance.
constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr unsigned kPortableClusterBlocks = 8, kMaxClusterBlocks = 16;  // CUDA's, on any device
constexpr size_t kStaticAlign = 64;  // the largest alignment a __shared__ variable may ask for
constexpr size_t kDynamicAlign =
    16;  // what CUDA guarantees for extern __shared__ (no more, so that no kernel relies on it)

struct Storage {
  char* data = nullptr;
  size_t bytes = 0, align = kDynamicAlign;
  bool contains(const void* p) const {
    const char* c = static_cast<const char*>(p);
    return bytes > 0 && c >= data && c < data + bytes;
  }
};

Storage allocate(size_t bytes, size_t align) {
  Storage s{static_cast<char*>(operator new(bytes, std::align_val_t(align))), bytes, align};
  memset(s.data, 0xff, bytes);  // NaN in every float type: a read before the block wrote it shows
  return s;
}

void set_poisoned(const Storage& s, bool poisoned) {
#if CUDA_EMU_ASAN
  if (poisoned) {
    __asan_poison_memory_region(s.data, s.bytes);
  } else {
    __asan_unpoison_memory_region(s.data, s.bytes);
  }
#endif
}

struct BlockShared {
  uint3 block_idx{};
  std::map<std::string, Storage> vars;  // the __shared__ variables, by declaration site
  size_t static_bytes = 0;
  Storage dynamic;
  bool exited = false;
};

struct SharedState {
  DeviceLimits limits;
  std::map<const void*, size_t> allowed;    // GRPO_ALLOW_DYNAMIC_SHARED, by kernel instantiation
  std::map<const void*, bool> nonportable;  // GRPO_ALLOW_NONPORTABLE_CLUSTER, by kernel instantiation
  cudaError_t pending = cudaSuccess;
  std::string pending_what;
  // The running cluster's.
  const LaunchSpec* spec = nullptr;
  long long allowance = -1;  // the running kernel's GRPO_ALLOW_DYNAMIC_SHARED; -1: none
  std::vector<BlockShared> blocks;
};
SharedState state;

std::string block_str(uint3 b) {
  return "block (" + std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

// The running block's static and dynamic shared memory against the limits (the static part grows as the kernel
// declares its variables).
void check_static(const BlockShared& b) {
  const size_t dynamic = state.spec->shared_bytes, total = b.static_bytes + dynamic;
  const size_t device = state.limits.max_shared_per_block;
  const std::string sizes = "the block's __shared__ variables (" + std::to_string(b.static_bytes) +
                            " bytes) and dynamic shared memory (" + std::to_string(dynamic) + " bytes)";
  if (b.static_bytes > kDefaultSharedLimit) {
    fail("the block's __shared__ variables take " + std::to_string(b.static_bytes) + " bytes, over 48 KiB");
  } else if (total > device) {
    fail(sizes + " exceed the device's " + std::to_string(device) +
         " bytes per block: a GPU refuses the launch (a launcher's budget must count the kernel's static shared "
         "memory)");
  } else if (state.allowance < 0 && total > kDefaultSharedLimit) {
    fail(sizes +
         " exceed 48 KiB, and GRPO_ALLOW_DYNAMIC_SHARED did not allow the kernel more: a GPU refuses the launch");
  } else if (state.allowance >= 0 && b.static_bytes + static_cast<size_t>(state.allowance) > device) {
    fail("GRPO_ALLOW_DYNAMIC_SHARED(" + std::to_string(state.allowance) + ") plus the kernel's " +
         std::to_string(b.static_bytes) + " bytes of __shared__ variables exceed the device's " +
         std::to_string(device) + " bytes per block: on a GPU, cudaFuncSetAttribute fails");
  }
}

// Block `rank`'s storage of the __shared__ variable declared at `site`, allocated on first use.
Storage& shared_var(unsigned rank, const std::string& site, size_t bytes, size_t align) {
  BlockShared& b = state.blocks[rank];
  auto it = b.vars.find(site);
  if (it != b.vars.end()) {
    if (it->second.bytes != bytes) fail("__shared__ " + site + " declared with two sizes");
    return it->second;
  }
  if (align > kStaticAlign) fail("__shared__ " + site + ": alignment over 64 bytes");
  b.static_bytes += bytes;
  check_static(b);
  return b.vars.emplace(site, allocate(bytes, kStaticAlign)).first->second;
}

#if CUDA_EMU_ASAN
// Runs after an ASan report, before the process exits: names the bug when the bad address is the shared memory of
// a block of the running cluster that has exited (a peer's access after its last thread left).
void explain_asan_report() {
  const void* address = __asan_get_report_address();
  for (const BlockShared& b : state.blocks) {
    bool hit = b.exited && b.dynamic.contains(address);
    for (const auto& [site, var] : b.vars) hit = hit || (b.exited && var.contains(address));
    if (!hit) continue;
    const Coords* c = running_coords();
    std::string who = "a thread";
    if (c != nullptr) {
      who = block_str(c->block_idx) + " thread (" + std::to_string(c->thread_idx.x) + "," +
            std::to_string(c->thread_idx.y) + "," + std::to_string(c->thread_idx.z) + ")";
    }
    fprintf(stderr,
            "cuda_emu: %s of %s accessed the shared memory of %s of its cluster after all of that block's threads "
            "had exited (on a GPU it is gone: the kernel must cluster_sync before its blocks exit)\n",
            who.c_str(), state.spec ? state.spec->kernel : "?", block_str(b.block_idx).c_str());
  }
}
const bool kExplainRegistered = (__sanitizer_set_death_callback(explain_asan_report), true);
#endif

}  // namespace

const DeviceLimits& device_limits() {
  return state.limits;
}

void set_device_limits(const DeviceLimits& limits) {
  state.limits = limits;
}

void set_pending_error(cudaError_t error, const std::string& what) {
  state.pending = error;
  state.pending_what = what;
}

std::string take_pending_error() {
  std::string what = state.pending == cudaSuccess ? "" : state.pending_what;
  state.pending = cudaSuccess;
  state.pending_what.clear();
  return what;
}

cudaError_t allow_dynamic_shared(const void* kernel, long long bytes, const char* name, const char* file, int line) {
  if (bytes < 0 || static_cast<unsigned long long>(bytes) > state.limits.max_shared_per_block) {
    set_pending_error(cudaErrorInvalidValue,
                      std::string(name) + " (" + file + ":" + std::to_string(line) + "): GRPO_ALLOW_DYNAMIC_SHARED(" +
                          std::to_string(bytes) + ") is over the device's " +
                          std::to_string(state.limits.max_shared_per_block) + " bytes per block");
    return cudaErrorInvalidValue;
  }
  state.allowed[kernel] = static_cast<size_t>(bytes);
  return cudaSuccess;
}

cudaError_t allow_nonportable_cluster(const void* kernel) {
  state.nonportable[kernel] = true;
  return cudaSuccess;
}

std::string check_cluster_and_shared(const LaunchSpec& spec, bool* refused) {
  const unsigned n = spec.cluster_blocks;
  const auto allowed = state.allowed.find(spec.function);
  const size_t allowance = allowed == state.allowed.end() ? kDefaultSharedLimit : allowed->second;
  const bool nonportable = state.nonportable.count(spec.function) > 0;
  const unsigned device_max =
      nonportable ? state.limits.max_nonportable_cluster_blocks : state.limits.max_cluster_blocks;
  std::ostringstream s;
  *refused = false;
  if (n == 0) {
    s << "a cluster of 0 blocks";
  } else if (spec.grid.x % n != 0) {
    s << "grid.x (" << spec.grid.x << ") is not a multiple of the cluster size (" << n << ")";
  } else if (n > kMaxClusterBlocks) {
    s << "a cluster of " << n << " blocks, over CUDA's maximum of " << kMaxClusterBlocks;
  } else if (n > kPortableClusterBlocks && !nonportable) {
    s << "a cluster of " << n << " blocks, over the portable " << kPortableClusterBlocks
      << " without GRPO_ALLOW_NONPORTABLE_CLUSTER (cudaFuncAttributeNonPortableClusterSizeAllowed)";
  } else if (n > 1 && n > device_max) {  // a single block is an ordinary launch anywhere
    *refused = true;
    s << "a cluster of " << n << " blocks, over the device's maximum of " << device_max;
  } else if (spec.shared_bytes > state.limits.max_shared_per_block) {
    *refused = true;
    s << spec.shared_bytes << " bytes of dynamic shared memory per block, over the device's "
      << state.limits.max_shared_per_block;
  } else if (spec.shared_bytes > allowance) {
    s << spec.shared_bytes << " bytes of dynamic shared memory, over the kernel's maximum of " << allowance
      << (allowed == state.allowed.end() ? " (GRPO_ALLOW_DYNAMIC_SHARED raises it)"
                                         : " (set by GRPO_ALLOW_DYNAMIC_SHARED)");
  }
  return s.str();
}

void begin_cluster(const LaunchSpec& spec, uint3 first, unsigned blocks) {
  state.spec = &spec;
  const auto allowed = state.allowed.find(spec.function);
  state.allowance = allowed == state.allowed.end() ? -1 : static_cast<long long>(allowed->second);
  state.blocks.assign(blocks, BlockShared{});
  for (unsigned r = 0; r < blocks; ++r) {
    state.blocks[r].block_idx = {first.x + r, first.y, first.z};
    state.blocks[r].dynamic = allocate(spec.shared_bytes, kDynamicAlign);
  }
}

void block_exited(unsigned rank) {
  BlockShared& b = state.blocks[rank];
  b.exited = true;
  set_poisoned(b.dynamic, true);
  for (const auto& [site, var] : b.vars) set_poisoned(var, true);
}

void end_cluster() {
  for (BlockShared& b : state.blocks) {
    for (Storage* s : {&b.dynamic}) {
      set_poisoned(*s, false);
      operator delete(s->data, std::align_val_t(s->align));
    }
    for (auto& [site, var] : b.vars) {
      set_poisoned(var, false);
      operator delete(var.data, std::align_val_t(var.align));
    }
  }
  state.blocks.clear();
  state.spec = nullptr;
}

void* shared_storage(const char* site, size_t bytes, size_t align) {
  if (running_coords() == nullptr) throw LaunchError("__shared__ variable used outside a kernel");
  return shared_var(running_block_rank(), site, bytes, align).data;
}

void* dynamic_shared_storage() {
  return state.blocks[running_block_rank()].dynamic.data;
}

void* map_shared(const void* p, unsigned rank) {
  const unsigned me = running_block_rank(), blocks = static_cast<unsigned>(state.blocks.size());
  if (rank >= blocks) {
    fail("cluster_map_shared to rank " + std::to_string(rank) + ", but the cluster has " + std::to_string(blocks) +
         " block" + (blocks == 1 ? "" : "s"));
  }
  const BlockShared& mine = state.blocks[me];
  const char* c = static_cast<const char*>(p);
  const std::string* site = nullptr;  // the __shared__ variable p points into; null: the dynamic shared memory
  size_t offset = 0;
  if (mine.dynamic.contains(p)) {
    offset = static_cast<size_t>(c - mine.dynamic.data);
  } else {
    for (const auto& [s, var] : mine.vars) {
      if (var.contains(p)) {
        site = &s;
        offset = static_cast<size_t>(c - var.data);
      }
    }
    if (site == nullptr) {
      std::ostringstream s;
      s << "cluster_map_shared(" << p << ", " << rank
        << "): the pointer is not in this block's shared memory (a __shared__ variable or the dynamic shared memory)";
      fail(s.str());
    }
  }
  if (rank == me) return const_cast<char*>(c);
  const BlockShared& peer = state.blocks[rank];
  if (peer.exited) {
    fail("cluster_map_shared onto " + block_str(peer.block_idx) + " (rank " + std::to_string(rank) +
         "), whose threads have all exited: its shared memory is gone (cluster_sync before a block exits)");
  }
  if (site == nullptr) return peer.dynamic.data + offset;
  const Storage& var = mine.vars.at(*site);
  return shared_var(rank, *site, var.bytes, var.align).data + offset;
}

}  // namespace cuda_emu

cudaError_t cudaGetLastError() {
  const cudaError_t error = cudaPeekAtLastError();
  cuda_emu::take_pending_error();
  return error;
}

cudaError_t cudaPeekAtLastError() {
  return cuda_emu::state.pending;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
  }
  return "unrecognized error code";
}
