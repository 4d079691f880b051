// Thread-block clusters (sm_90), dynamic shared memory and asynchronous copies into it, as the kernel headers use
// them. A cluster is
// `cluster_num_blocks()` consecutive blocks along x that run at the same time on one GPC and can read and write each
// other's shared memory (distributed shared memory). Below sm_90 a cluster is a single block.
//
// tests/cuda_emu (runtime.h) defines GRPO_CLUSTER_API and its own versions of these functions, which run the blocks
// of a cluster together on the CPU and check what the hardware requires.
#pragma once

#ifndef GRPO_CLUSTER_API
#define GRPO_CLUSTER_API 1

#include <cooperative_groups.h>
#include <cuda_runtime.h>

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

// Starts a copy of 16 bytes from global to shared memory that holds no register (cp.async.cg, sm_80 and newer): a
// thread can have all of its part of a row in flight at once, where loads through registers keep only kRowUnroll
// vectors (vector_io.cuh). Both addresses 16-byte aligned. The bytes are there, for this thread, after
// async_copy_wait_all(); for the block's other threads, after that and a barrier. Before sm_80: a plain copy.
__device__ __forceinline__ void async_copy_16(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global) : "memory");
#else
  *static_cast<uint4*>(shared) = *static_cast<const uint4*>(global);
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
