// Thread-block clusters (sm_90), dynamic shared memory, asynchronous copies into it, and mbarriers with pushes into a
// peer's shared memory, as the kernel headers use them. A cluster is `cluster_num_blocks()` consecutive blocks along
// x that run at the same time on one GPC and can read and write each other's shared memory (distributed shared
// memory). Below sm_90 a cluster is a single block.
//
// tests/cuda_emu (runtime.h) defines GRPO_CLUSTER_API and its own versions of these functions, which run the blocks
// of a cluster together on the CPU and check what the hardware requires.
#pragma once

#ifndef GRPO_CLUSTER_API
#define GRPO_CLUSTER_API 1

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace grpo_ext {

// This block's rank in its cluster, 0 to cluster_num_blocks() - 1.
__device__ __forceinline__ unsigned cluster_block_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  return 0;
#endif
}

__device__ __forceinline__ unsigned cluster_num_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().num_blocks();
#else
  return 1;
#endif
}

// A barrier of every thread of every block of the cluster; shared-memory writes before it (in any block of the
// cluster) are visible after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// The address of `p` (in this block's shared memory) in the shared memory of the cluster's block `rank`.
template <typename T>
__device__ __forceinline__ T* cluster_map_shared(T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  return p;
#endif
}

// The block's dynamic shared memory (the launch's `shared_bytes`), 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
  extern __shared__ uint4 grpo_dynamic_shared[];
  return reinterpret_cast<T*>(grpo_dynamic_shared);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// `p`'s address in the shared state space (cp.async, mbarriers, st.async take it).
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// Starts a copy of 16 bytes from global to shared memory that holds no register (cp.async.cg, sm_80 and newer): a
// thread can have all of its part of a row in flight at once, where loads through registers keep only kRowUnroll
// vectors (vector_io.cuh). Both addresses 16-byte aligned. The bytes are there, for this thread, after
// async_copy_wait_all(); for the block's other threads, after that and a barrier. Before sm_80: a plain copy.
__device__ __forceinline__ void async_copy_16(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global) : "memory");
#else
  *static_cast<uint4*>(shared) = *static_cast<const uint4*>(global);
#endif
}

// A transaction barrier (sm_90's mbarrier) in this block's shared memory. Each phase completes when its `arrivals`
// threads have arrived (mbarrier_arrive_expect_tx) and every byte they announced has landed (cluster_push), then the
// next phase starts; phases alternate parity 0, 1, 0, ... Before sm_90 a cluster is one block: cluster_push is a
// plain store and mbarrier_wait a __syncwarp, so there the pushing and waiting threads must be one warp's.
using Mbarrier = uint64_t;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The address of shared address `address` in the shared memory of the cluster's block `rank` (mapa).
__device__ __forceinline__ unsigned cluster_shared_address(unsigned address, unsigned rank) {
  unsigned mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(address), "r"(rank));
  return mapped;
}
#endif

// One thread: `bar` starts at phase 0, each phase awaiting `arrivals` threads.
__device__ __forceinline__ void mbarrier_init(Mbarrier* bar, unsigned arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
#else
  (void)bar;
  (void)arrivals;
#endif
}

// Every thread of every block of the cluster, once, after its block's mbarrier_init calls: the cluster's blocks
// may push to those mbarriers afterwards. A cluster barrier with no release of other memory (fence.mbarrier_init and
// a relaxed arrive): cluster_sync's release/acquire compiles to a GPU-scope MEMBAR that waits for the thread's
// outstanding global stores (benchmarks/NOTES.md, "The cluster handshake without a GPU-scope fence").
__device__ __forceinline__ void cluster_sync_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __syncthreads();
#endif
}

// This thread arrives at `bar` (one of its phase's arrivals) and announces `bytes` more to land in the phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(Mbarrier* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#else
  (void)bar;
  (void)bytes;
#endif
}

// Writes `value` at `slot`'s offset in the shared memory of the cluster's block `rank` and counts its bytes on the
// mbarrier at `bar`'s offset there (st.async, 16 bytes at a time: no fence, no wait for it to land). `slot` and
// `bar` point into this block's shared memory; V is 16-byte aligned, its size a multiple of 16.
template <typename V>
__device__ __forceinline__ void cluster_push(V* slot, unsigned rank, const V& value, Mbarrier* bar) {
  static_assert(sizeof(V) % 16 == 0 && alignof(V) >= 16, "cluster_push moves 16-byte aligned pieces");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned to = cluster_shared_address(shared_address(slot), rank);
  const unsigned at = cluster_shared_address(shared_address(bar), rank);
  const uint4* words = reinterpret_cast<const uint4*>(&value);
#pragma unroll
  for (unsigned i = 0; i < sizeof(V) / 16; ++i) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(to + 16 * i),
        "r"(words[i].x), "r"(words[i].y), "r"(words[i].z), "r"(words[i].w), "r"(at)
        : "memory");
  }
#else
  (void)rank;
  (void)bar;
  *slot = value;
#endif
}

// Waits until the phase of `bar` with parity `parity` has completed; what was pushed in it is then visible to this
// thread.
__device__ __forceinline__ void mbarrier_wait(Mbarrier* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned address = shared_address(bar);
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, "
        "0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
#else
  (void)bar;
  (void)parity;
  __syncwarp();
#endif
}

// Waits for every async_copy_16 this thread started.
__device__ __forceinline__ void async_copy_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace grpo_ext

#endif  // GRPO_CLUSTER_API
