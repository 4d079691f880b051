// Kernels with one known bug each, and a conversion kernel: tests/cuda_emu/test_runtime.py checks that the harness
// reports each bug (and converts as CUDA does). Compiled like csrc/cuda/*.cuh: __shared__ rewritten by build.py,
// launch bounds read from here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"

namespace selftest {

// Threads of one block take different barriers (a barrier inside a branch on threadIdx).
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Half of the block returns before a barrier the other half waits at.
__global__ void early_exit_barrier_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Warp 0 waits in a shuffle for lane 0, which waits at a barrier: neither can go on.
__global__ void deadlock_kernel(float* out) {
  float v = 1.0f;
  if (threadIdx.x == 0) __syncthreads();
  if (threadIdx.x != 0) v = __shfl_down_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// A shuffle over half a warp reads from the other half (lane + 16 is outside the mask).
__global__ void shuffle_outside_mask_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_down_sync(0x0000ffffu, v, 8);
  if (threadIdx.x < 16) v += __shfl_down_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

// A lane calls a shuffle with a mask that does not name it.
__global__ void lane_not_in_mask_kernel(float* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1.0f, 0);
}

// Thread 0 fills a shared value that the others read without a barrier: a race the schedules tell apart.
__global__ void missing_barrier_kernel(float* out) {
  __shared__ float value;
  if (threadIdx.x == 0) value = 2.0f;
  out[threadIdx.x] = value;
}

// Writes one element past a shared array.
__global__ void shared_overflow_kernel(float* out) {
  __shared__ float scratch[32];
  scratch[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = scratch[threadIdx.x];
}

// Reads one element past a device buffer.
__global__ void global_overflow_kernel(const float* in, float* out, int n) {
  out[threadIdx.x] = in[threadIdx.x + 1];
}

__global__ void device_assert_kernel(float* out) {
  CUDA_KERNEL_ASSERT(threadIdx.x < 8);
  out[threadIdx.x] = 1.0f;
}

__global__ void __launch_bounds__(64) bounded_kernel(float* out) {
  out[threadIdx.x] = 1.0f;
}

// Butterfly sums over every xor offset and width, up/down/idx shuffles, ballots and votes: each lane's results.
__global__ void warp_intrinsics_kernel(int* out) {
  const int lane = threadIdx.x & 31;
  int* o = out + threadIdx.x * 8;
  int x = lane;
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  o[0] = x;
  o[1] = __shfl_up_sync(0xffffffffu, lane, 3, 8);
  o[2] = __shfl_down_sync(0xffffffffu, lane, 5, 16);
  o[3] = __shfl_sync(0xffffffffu, lane * 10, lane + 7, 4);
  o[4] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = __any_sync(0xffffffffu, lane == 31);
  o[6] = __all_sync(0xffffffffu, lane < 31);
  __syncwarp();
  o[7] = lane < 16 ? __shfl_xor_sync(0x0000ffffu, lane, 1) : -1;
}

__global__ void convert_kernel(const float* in, __nv_bfloat16* bf16, __half* f16, float* back, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    bf16[i] = __float2bfloat16_rn(in[i]);
    f16[i] = __float2half_rn(in[i]);
    back[2 * i] = __bfloat162float(bf16[i]);
    back[2 * i + 1] = __half2float(f16[i]);
  }
}

}  // namespace selftest
