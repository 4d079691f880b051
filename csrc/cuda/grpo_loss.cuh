// CUDA kernels of the fused GRPO loss, on raw pointers and a stream (no torch types).
//
// Forward = one block per row (loss, metrics partials and the raw gradient d loss/d logps up to a global scalar)
// + one single-block reduction of the row partials in a fixed order (loss, metrics, that scalar). The global scalar
// (1/B, 1/sum(mask), 1/num_items, times loss_scale) is only known after every row is seen, so the gradient keeps it
// apart and the backward kernel applies it together with grad_output: backward is a single scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../grpo_loss_math.h"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// Up to 512 threads per block (loss_threads_per_row).
template <typename T>
__global__ void __launch_bounds__(512)
    grpo_loss_rows_kernel(LossParams p, LossInputs in, T* __restrict__ grad, T* __restrict__ partials) {
  __shared__ T scratch[(kNumRowSlots + 1) * 32];
  const int64_t n_cols = in.seq_len;
  const bool vespo = p.loss_type == LossType::kVESPO;
  const bool need_count = per_row_normalized(p.loss_type) || p.sequence_level || vespo;
  const bool want_kl = p.beta != 0.0;
  const TokenConsts<T> consts(p);
  const PolicyFamily family = policy_family(p.loss_type);
  const KLKind kl = kl_kind(p);
  for (int64_t row = blockIdx.x; row < in.batch; row += gridDim.x) {
    T* grad_row = grad ? grad + row * n_cols : nullptr;
    T pass1[3] = {T(0), T(0), T(0)};  // sum m, sum m * (l - l_old), vespo's sum of log-weight terms
    if (need_count) {
      for (int64_t t = threadIdx.x; t < n_cols; t += blockDim.x) {
        const T m = in.mask_at<T>(row, t);
        if (m == T(0)) continue;
        pass1[0] += m;
        if (p.sequence_level || vespo) {  // on-policy: l - l, 0 or NaN (a non-finite l makes the row's ratio NaN)
          const T l = in.logps.load<T>(row, t);
          const T d = log_ratio_of(l, p.has_old ? in.old_logps.load<T>(row, t) : l);
          if (p.sequence_level) pass1[1] += m * d;
          if (vespo) {
            const T isw = in.is_weights.present() ? in.is_weights.load<T>(row, t) : T(1);
            pass1[2] += m * vespo_token_log_weight(d, isw, in.is_weights.present());
          }
        }
      }
      block_sum<T, 3>(pass1, scratch);
    }
    const T count_clamped = pass1[0] > T(1) ? pass1[0] : T(1);
    const T seq_ratio = p.sequence_level ? math_exp(pass1[1] / count_clamped) : T(1);
    const T row_factor = per_row_normalized(p.loss_type) ? T(1) / count_clamped : T(1);
    const T vespo_log_w = vespo_row_log_weight(pass1[2]);

    T acc[kNumRowSlots + 1];  // the row slots, then sum_t w * dP/drho (sequence level)
#pragma unroll
    for (int s = 0; s <= kNumRowSlots; ++s) acc[s] = T(0);
    for (int64_t t = threadIdx.x; t < n_cols; t += blockDim.x) {
      const T m = in.mask_at<T>(row, t);
      if (m == T(0)) {
        if (grad_row) grad_row[t] = T(0);
        continue;
      }
      const T l = in.logps.load<T>(row, t);
      const T l_old = p.has_old && !p.sequence_level ? in.old_logps.load<T>(row, t) : l;
      const T rho = p.sequence_level ? seq_ratio : math_exp(log_ratio_of(l, l_old));
      const T adv = in.advantages.load<T>(row, t);
      const T l_ref = want_kl ? in.ref_logps.load<T>(row, t) : T(0);
      // vespo: the token's phi in place of its is_weight (docs/math.md section 3)
      const T isw = vespo ? vespo_phi(consts, vespo_log_w, adv)
                          : (in.is_weights.present() ? in.is_weights.load<T>(row, t) : T(1));
      const TokenTerms<T> tt = token_terms<T>(consts, family, kl, p.bias_correction, l, l_ref, adv, isw, rho);
      const T w = m * row_factor;
      acc[kSlotLoss] += w * tt.loss;
      acc[kSlotMask] += m;
      acc[kSlotKL] += m * tt.kl;
      acc[kSlotLow] += tt.low * m;
      acc[kSlotHigh] += tt.high * m;
      acc[kSlotRegion] += (tt.low + tt.high) * m;  // low and high never hold together
      acc[kSlotCispo] += tt.cispo_clipped * m;
      if (vespo) acc[kSlotPhi] += isw * m;
      if (grad_row) {
        if (p.sequence_level) {
          acc[kNumRowSlots] += w * tt.dloss_drho;
          grad_row[t] = w * tt.dloss_dl;
        } else {
          grad_row[t] = w * (tt.dloss_dl + tt.dloss_drho * rho);
        }
      }
    }
    block_sum<T, kNumRowSlots + 1>(acc, scratch);
    if (threadIdx.x == 0) {
      if (p.row_share_metrics) {  // one condition per row, every row counted
        clip_flags<T>(consts, seq_ratio, in.advantages.load<T>(row, 0), &acc[kSlotLow], &acc[kSlotHigh],
                      &acc[kSlotCispo]);
        acc[kSlotRegion] = acc[kSlotLow] + acc[kSlotHigh];
      }
      acc[kSlotNonEmpty] = acc[kSlotMask] > T(0) ? T(1) : T(0);
      if (vespo && p.per_row_advantages) acc[kSlotPhi] = vespo_phi(consts, vespo_log_w, in.advantages.load<T>(row, 0));
#pragma unroll
      for (int s = 0; s < kNumRowSlots; ++s) partials[row * kNumRowSlots + s] = acc[s];
    }
    if (grad_row && p.sequence_level) {
      // d s_i / d l[i,t] = s_i * m[i,t] / max(n_i, 1); each thread revisits only the tokens it wrote above.
      const T through_ratio = acc[kNumRowSlots] * seq_ratio / count_clamped;
      for (int64_t t = threadIdx.x; t < n_cols; t += blockDim.x) {
        const T m = in.mask_at<T>(row, t);
        if (m != T(0)) grad_row[t] += through_ratio * m;
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    grpo_loss_finalize_kernel(LossParams p, const T* __restrict__ partials, int64_t batch,
                              int64_t max_completion_length, bool has_num_items, T num_items_value,
                              const T* __restrict__ num_items_device, T loss_scale, T* loss_out, T* metrics_out,
                              T* grad_scale_out) {
  __shared__ T scratch[kNumRowSlots * 32];
  T totals[kNumRowSlots];
#pragma unroll
  for (int s = 0; s < kNumRowSlots; ++s) totals[s] = T(0);
  for (int64_t row = threadIdx.x; row < batch; row += blockDim.x) {
#pragma unroll
    for (int s = 0; s < kNumRowSlots; ++s) totals[s] += partials[row * kNumRowSlots + s];
  }
  block_sum<T, kNumRowSlots>(totals, scratch);
  if (threadIdx.x == 0) {
    const T num_items = num_items_device ? num_items_device[0] : num_items_value;
    finalize_loss<T>(p, totals, batch, max_completion_length, has_num_items, num_items, loss_scale, loss_out,
                     metrics_out, grad_scale_out);
  }
}

template <typename Out>
__device__ __forceinline__ Out convert_out(float v);
template <>
__device__ __forceinline__ float convert_out<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 convert_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half convert_out<__half>(float v) {
  return __float2half_rn(v);
}

// grad_logps = grad_raw * (grad_loss * grad_scale), written in the logps dtype.
template <typename T, typename Out>
__global__ void __launch_bounds__(256)
    grpo_loss_backward_kernel(const T* __restrict__ grad_raw, const T* __restrict__ grad_loss,
                              const T* __restrict__ grad_scale, Out* __restrict__ out, int64_t n) {
  const T factor = grad_loss[0] * grad_scale[0];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = convert_out<Out>(grad_raw[i] * factor);
  }
}
template <>
__global__ void __launch_bounds__(256) grpo_loss_backward_kernel<double, double>(const double* __restrict__ grad_raw,
                                                                                 const double* __restrict__ grad_loss,
                                                                                 const double* __restrict__ grad_scale,
                                                                                 double* __restrict__ out, int64_t n) {
  const double factor = grad_loss[0] * grad_scale[0];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = grad_raw[i] * factor;
  }
}

// Threads per row: enough for ~8 tokens each, a warp at least, 512 at most.
inline int loss_threads_per_row(int64_t seq_len) {
  const int64_t want = (seq_len + 7) / 8;
  return round_up_to_warp(want < 32 ? 32 : (want > 512 ? 512 : want));
}

template <typename T>
void launch_grpo_loss_forward(const LossParams& p, const LossInputs& in, int64_t max_completion_length,
                              bool has_num_items, T num_items_value, const T* num_items_device, T loss_scale, T* grad,
                              T* partials, T* loss_out, T* metrics_out, T* grad_scale_out, cudaStream_t stream) {
  const int64_t max_blocks = int64_t(1) << 30;
  const unsigned blocks = static_cast<unsigned>(in.batch < max_blocks ? in.batch : max_blocks);
  GRPO_LAUNCH(blocks, loss_threads_per_row(in.seq_len), 0, stream, grpo_loss_rows_kernel<T>)(p, in, grad, partials);
  GRPO_LAUNCH(1, 256, 0, stream, grpo_loss_finalize_kernel<T>)(p, partials, in.batch, max_completion_length,
                                                               has_num_items, num_items_value, num_items_device,
                                                               loss_scale, loss_out, metrics_out, grad_scale_out);
}

template <typename T, typename Out>
void launch_grpo_loss_backward(const T* grad_raw, const T* grad_loss, const T* grad_scale, Out* out, int64_t n,
                               int num_sms, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = int64_t(num_sms) * 8;
  if (blocks > cap) blocks = cap;
  GRPO_LAUNCH(static_cast<unsigned>(blocks), threads, 0, stream, grpo_loss_backward_kernel<T, Out>)(grad_raw, grad_loss,
                                                                                                    grad_scale, out, n);
}

}  // namespace grpo_ext
