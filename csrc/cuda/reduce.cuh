// Deterministic warp and block sums: a fixed shuffle tree, then a fixed tree over warps; every thread gets the same
// bits back. No atomics, so the same inputs always give the same outputs.
#pragma once

#include <cuda_runtime.h>

namespace grpo_ext {

constexpr unsigned kFullWarp = 0xffffffffu;

// Sum over the warp; every lane receives lane 0's result.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullWarp, v, offset);
  return __shfl_sync(kFullWarp, v, 0);
}

// Sums N values over the block (blockDim.x a multiple of 32, at most 1024); every thread receives the totals.
// `scratch` holds at least N * 32 elements of shared memory.
template <typename T, int N>
__device__ __forceinline__ void block_sum(T (&v)[N], T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i * 32 + warp] = v[i];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      T x = lane < num_warps ? scratch[i * 32 + lane] : T(0);
      x = warp_sum(x);
      if (lane == 0) scratch[i * 32] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = scratch[i * 32];
  __syncthreads();  // the scratch may be reused right after
}

// Inclusive prefix sum of one int per thread over the block in thread order (blockDim.x a multiple of 32, at most
// 1024): shuffles within each warp, then over the warps' totals in warp 0. `total` receives the block's sum in every
// thread. `scratch`: 32 ints of shared memory, free again when this returns.
__device__ __forceinline__ int block_inclusive_scan(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int before = __shfl_up_sync(kFullWarp, v, offset);
    if (lane >= offset) v += before;
  }
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int t = lane < num_warps ? scratch[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int before = __shfl_up_sync(kFullWarp, t, offset);
      if (lane >= offset) t += before;
    }
    scratch[lane] = t;  // the warps' inclusive totals
  }
  __syncthreads();
  total = scratch[num_warps - 1];
  v += warp > 0 ? scratch[warp - 1] : 0;
  __syncthreads();  // scratch is free for the caller again
  return v;
}

// Max of one value per thread over the block (blockDim.x a multiple of 32, at most 1024; no NaN); every thread
// receives it. `scratch`: 32 elements of shared memory, free again when this returns.
template <typename T>
__device__ __forceinline__ T block_max(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(kFullWarp, v, offset);
    v = other > v ? other : v;
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < num_warps; ++w) v = scratch[w] > v ? scratch[w] : v;
  __syncthreads();  // scratch is free for the caller again
  return v;
}

inline int round_up_to_warp(int64_t n) {
  return static_cast<int>(((n + 31) / 32) * 32);
}

}  // namespace grpo_ext
