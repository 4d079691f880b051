// CUDA kernel of process_advantages, on raw pointers and a stream (no torch types): one block per group.
#pragma once

#include <cuda_runtime.h>

#include "../advantages_math.h"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// One block per group: the group's step statistics, then every token's suffix sum of normalized step rewards.
// num_groups = batch / group_size comes from the launcher: computed here, it stayed live in a register across the
// float64 division calls and spilled (16 B in the float64 instantiation).
template <typename T>
__global__ void __launch_bounds__(256)
    process_advantages_kernel(StridedMatrix rewards, StridedMatrix step_end, int64_t num_groups, int64_t num_steps,
                              int64_t group_size, int64_t seq_len, T eps, int64_t std_ddof, T* __restrict__ out) {
  __shared__ T scratch[2 * 32];
  const int64_t cells = group_size * num_steps;
  auto valid = [&](int64_t row, int64_t j, T* reward) {
    const T r = rewards.load<T>(row, j);
    *reward = r;
    return is_scored(r) && step_end.load<int64_t>(row, j) >= 0;
  };
  for (int64_t g = blockIdx.x; g < num_groups; g += gridDim.x) {
    const int64_t base = g * group_size;
    // The group's statistics in units of 2^e (advantages_math.h: e = 0 up to 2^40), so that they cannot overflow.
    T max_abs = T(0), r;
    for (int64_t c = threadIdx.x; c < cells; c += blockDim.x) {
      if (valid(base + c / num_steps, c % num_steps, &r)) max_abs = max_scored_abs(max_abs, r);
    }
    const int exponent = scale_exponent(block_max(max_abs, scratch));
    const T unit = times_pow2(T(1), -exponent);
    T s[2] = {T(0), T(0)};
    for (int64_t c = threadIdx.x; c < cells; c += blockDim.x) {
      if (valid(base + c / num_steps, c % num_steps, &r)) {
        s[0] += r * unit;
        s[1] += T(1);
      }
    }
    block_sum<T, 2>(s, scratch);
    const T mu = safe_mean(s[0], s[1]);
    T sq[1] = {T(0)};
    for (int64_t c = threadIdx.x; c < cells; c += blockDim.x) {
      if (valid(base + c / num_steps, c % num_steps, &r)) sq[0] += (r * unit - mu) * (r * unit - mu);
    }
    block_sum<T, 1>(sq, scratch);
    const T denom = std_from_sum_sq(sq[0], s[1], std_ddof) + times_pow2(eps, -exponent);
    for (int64_t c = threadIdx.x; c < group_size * seq_len; c += blockDim.x) {
      const int64_t row = base + c / seq_len, t = c % seq_len;
      T a = T(0);
      for (int64_t j = 0; j < num_steps; ++j) {
        if (valid(row, j, &r) && step_end.load<int64_t>(row, j) >= t) a += scaled_ratio(r * unit - mu, denom);
      }
      out[row * seq_len + t] = a;
    }
  }
}

template <typename T>
void launch_process_advantages(const StridedMatrix& rewards, const StridedMatrix& step_end, int64_t batch,
                               int64_t num_steps, int64_t group_size, int64_t seq_len, T eps, int64_t std_ddof, T* out,
                               cudaStream_t stream) {
  const int64_t num_groups = batch / group_size;
  if (num_groups == 0) return;
  const int64_t max_blocks = int64_t(1) << 30;
  GRPO_LAUNCH(static_cast<unsigned>(num_groups < max_blocks ? num_groups : max_blocks), 256, 0, stream,
              process_advantages_kernel<T>)(rewards, step_end, num_groups, num_steps, group_size, seq_len, eps,
                                            std_ddof, out);
}

}  // namespace grpo_ext
