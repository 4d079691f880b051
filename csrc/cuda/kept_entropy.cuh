// The mean entropy over the kept tokens of grpo_loss_from_logits and its entropy bonus (plan/logits_loss.h), on raw
// pointers and a stream: one small kernel after the pass and the loss, so that the op returns them with no host
// sync and no further op call.
#pragma once

#include <cuda_runtime.h>

#include "../logits_loss_math.h"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// mean = sum m H / max(sum m, 1) and, when entropy_coef != 0, loss -= entropy_coef * loss_scale * (the bonus' mean)
// (entropy_means, entropy_bonus_scale).
// One block: a warp per row of the [B, T] masks, its lanes over the tokens, the four sums in float64 over the fixed
// trees of block_sum, so every call gives the same bits. Its reads are 2 * B * T small values against the pass's
// B * T * V: one block keeps up (the row weights of the pass are summed the same way).
template <typename T>
__global__ void __launch_bounds__(1024)
    kept_entropy_mean_kernel(LossInputs in, StridedMatrix entropy_weights, const T* __restrict__ entropy,
                             double entropy_coef, DeviceNumber<T> loss_scale, T* __restrict__ loss,
                             T* __restrict__ mean) {
  __shared__ double scratch[4 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  double sums[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t b = warp; b < in.batch; b += num_warps) {
    for (int64_t t = lane; t < in.seq_len; t += 32) {
      add_entropy_sums(sums, in.mask_at<double>(b, t), double(entropy[b * in.seq_len + t]), entropy_weights, b, t);
    }
  }
  block_sum<double, 4>(sums, scratch);
  if (threadIdx.x == 0) {
    const EntropyMeans means = entropy_means(sums, entropy_weights.present());
    *mean = T(means.mean);
    const double bonus_scale = entropy_bonus_scale(entropy_coef, loss_scale.get());
    if (bonus_scale != 0.0) *loss = T(double(*loss) - bonus_scale * means.weighted_mean);
  }
}

template <typename T>
void launch_kept_entropy_mean(const LossInputs& in, const StridedMatrix& entropy_weights, const T* entropy,
                              double entropy_coef, DeviceNumber<T> loss_scale, T* loss, T* mean, cudaStream_t stream) {
  GRPO_LAUNCH(1, 1024, 0, stream, kept_entropy_mean_kernel<T>)(in, entropy_weights, entropy, entropy_coef, loss_scale,
                                                               loss, mean);
}

}  // namespace grpo_ext
