// CUDA kernels of the fused GRPO loss, on raw pointers and a stream (no torch types).
//
// Forward = one block per row (loss, metrics partials and the raw gradient d loss/d logps up to a global scalar)
// + one single-block reduction of the row partials in a fixed order (loss, metrics, that scalar). The global scalar
// (1/B, 1/sum(mask), 1/num_items, times loss_scale) is only known after every row is seen, so the gradient keeps it
// apart and the backward kernel applies it together with grad_output: backward is a single scale.
// Precision as the CPU kernel's: per-token work and each thread's running sums in T, every sum across threads, the
// row partials and the batch totals in double (a few shuffles per row), which keeps a loss whose rows cancel (luspo's
// row sums are hundreds, their total 1e-2) as exact as the CPU's float64 row and batch sums do.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../grpo_loss_math.h"
#include "launch.cuh"
#include "reduce.cuh"
#include "token_io.cuh"
#include "vector_io.cuh"

namespace grpo_ext {

// Tokens per chunk (token_io.cuh): one 16-byte access per float32 input. Float64 (the reference dtype, not a timed
// one) reads one token at a time: two-token chunks took the rows kernel from 116 to 164 registers.
template <typename T>
constexpr int kLossChunk = sizeof(T) == 8 ? 1 : 4;

// Whether row `row` can be read in whole chunks of K tokens from token `head` on (token_io.cuh): every [B, T] input
// of a chunk dtype with unit stride (or broadcast) and on a chunk boundary there, and so the gradient row.
template <int K, typename T>
__device__ __forceinline__ bool loss_row_vectorizable(const LossInputs& in, int64_t row, int64_t head,
                                                      const T* grad_row) {
  bool ok =
      in.logps.col_stride == 1 && (!grad_row || reinterpret_cast<uintptr_t>(grad_row + head) % sizeof(Pack<T, K>) == 0);
  for (const StridedMatrix* m :
       {&in.logps, &in.old_logps, &in.ref_logps, &in.advantages, &in.is_weights, &in.policy_weights, &in.mask}) {
    const bool is_mask = m == &in.mask;
    ok = ok && chunk_aligned<K>(*m, row, head) && (!m->present() || m->col_stride == 0 || chunk_dtype<T>(*m, is_mask));
  }
  return ok;
}

// Up to 256 threads per block (loss_threads_per_row). Each thread reads its tokens in chunks of K (token_io.cuh):
// the mask first, then, if any token of the chunk is kept, every other input of the chunk before any is used. The
// chunks in flight take registers (122 float32, 128+ float64): the 256-thread bound lets ptxas use them without
// spilling (at 512 the float64 kernel spilled 20 B); either way one SM holds 512 threads of it.
template <typename T>
__global__ void __launch_bounds__(256)
    grpo_loss_rows_kernel(LossParams p, LossInputs in, T* __restrict__ grad, double* __restrict__ partials) {
  constexpr int K = kLossChunk<T>;
  __shared__ double scratch[(kNumRowSlots + 1) * 32];
  const int64_t n_cols = in.seq_len;
  const bool vespo = p.loss_type == LossType::kVESPO;
  const bool need_count = per_row_normalized(p.loss_type) || p.sequence_level || vespo;
  const bool want_kl = p.beta != 0.0;
  const TokenConsts<T> consts(p);
  const PolicyFamily family = policy_family(p.loss_type);
  const KLKind kl = kl_kind(p);
  for (int64_t row = blockIdx.x; row < in.batch; row += gridDim.x) {
    T* grad_row = grad ? grad + row * n_cols : nullptr;
    const int64_t head = chunk_head<K>(in.logps, row, n_cols);
    const bool vector = loss_row_vectorizable<K>(in, row, head, grad_row);
    const T sample = in.sample_mask.present() ? in.sample_mask.load<T>(row, 0) : T(1);
    // m_eff = completion_mask * sample_mask (LossInputs::mask_at) of the chunk's tokens; whether any is kept.
    const auto load_mask = [&](const TokenChunk& c, T(&m)[K]) {
      load_tokens<T, K>(in.mask, row, n_cols, c, m);
      bool any = false;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (in.sample_mask.present()) m[k] *= sample;
        any |= m[k] != T(0);
      }
      return any;
    };

    // sum m, sum m * (l - l_old), vespo's sum of log-weight terms, the kept tokens: over the block in double
    double row1[4] = {0.0, 0.0, 0.0, 0.0};
    if (need_count) {
      T pass1[4] = {T(0), T(0), T(0), T(0)};  // this thread's part
      for_each_chunk<K>(n_cols, vector, head, [&](const TokenChunk& c) {
        T m[K], l[K], l_old[K], isw[K];
        if (!load_mask(c, m)) return;
        const bool ratio = p.sequence_level || vespo;  // on-policy: l - l, 0 or NaN (a non-finite l: NaN ratio)
        if (ratio) load_tokens<T, K>(in.logps, row, n_cols, c, l, &m);
        if (ratio && p.has_old) load_tokens<T, K>(in.old_logps, row, n_cols, c, l_old, &m);
        if (vespo && in.is_weights.present()) load_tokens<T, K>(in.is_weights, row, n_cols, c, isw, &m);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (m[k] == T(0)) continue;
          pass1[0] += m[k];
          pass1[3] += T(1);
          if (!ratio) continue;
          const T d = log_ratio_of(l[k], p.has_old ? l_old[k] : l[k]);
          if (p.sequence_level) pass1[1] += m[k] * d;
          if (vespo) {
            const T w = in.is_weights.present() ? isw[k] : T(1);
            pass1[2] += m[k] * vespo_token_log_weight(d, w, in.is_weights.present());
          }
        }
      });
#pragma unroll
      for (int i = 0; i < 4; ++i) row1[i] = double(pass1[i]);
      block_sum<double, 4>(row1, scratch);
    }
    const double count_clamped = row1[0] > 1.0 ? row1[0] : 1.0;
    const bool lone_row = ratio_is_the_lone_tokens(p.sequence_level, row1[3], row1[0]);
    const T seq_ratio = p.sequence_level ? math_exp(T(row1[1] / count_clamped)) : T(1);
    const T row_factor = per_row_normalized(p.loss_type) ? T(1.0 / count_clamped) : T(1);
    const T vespo_log_w = vespo_row_log_weight(T(row1[2]));

    T acc[kNumRowSlots + 1];  // the row slots, then sum_t w * dP/drho (sequence level)
#pragma unroll
    for (int s = 0; s <= kNumRowSlots; ++s) acc[s] = T(0);
    for_each_chunk<K>(n_cols, vector, head, [&](const TokenChunk& c) {
      T m[K], g[K];
#pragma unroll
      for (int k = 0; k < K; ++k) g[k] = T(0);  // masked tokens' gradient
      const bool kept = load_mask(c, m);
      if (kept) {
        T l[K], l_old[K], adv[K], l_ref[K], isw[K];
        load_tokens<T, K>(in.logps, row, n_cols, c, l, &m);
        const bool per_token_old = p.has_old && !p.sequence_level;
        if (per_token_old) load_tokens<T, K>(in.old_logps, row, n_cols, c, l_old, &m);
        load_tokens<T, K>(in.advantages, row, n_cols, c, adv, &m);
        if (want_kl) load_tokens<T, K>(in.ref_logps, row, n_cols, c, l_ref, &m);
        const bool given_isw = !vespo && in.is_weights.present();
        if (given_isw) load_tokens<T, K>(in.is_weights, row, n_cols, c, isw, &m);
        // The policy weights folded into isw right away (vespo reads no is_weights here): one K-array stays live.
        const bool given_pw = in.policy_weights.present();
        if (given_pw) {
          T pw[K];
          load_tokens<T, K>(in.policy_weights, row, n_cols, c, pw, &m);
#pragma unroll
          for (int k = 0; k < K; ++k) isw[k] = given_isw ? isw[k] * pw[k] : pw[k];
        }
        const bool given_w = given_isw || given_pw;
        // One token at a time through the run-time dispatch (one copy of its code: unrolled K times it was not
        // inlined and took a 700-byte stack frame), picking the token's values out of the chunk's registers.
#pragma unroll 1
        for (int k = 0; k < K; ++k) {
          const T mk = pick(m, k);
          if (mk == T(0)) continue;
          const T lk = pick(l, k), adv_k = pick(adv, k);
          const T rho = p.sequence_level ? seq_ratio : math_exp(log_ratio_of(lk, per_token_old ? pick(l_old, k) : lk));
          // vespo: the token's phi in place of its is_weight (docs/math.md section 3); the policy weights on either
          const T phi = vespo ? vespo_phi(consts, vespo_log_w, adv_k) : T(1);
          const T w_is = phi * (given_w ? pick(isw, k) : T(1));
          const TokenTerms<T> tt = token_terms<T>(consts, family, kl, p.bias_correction, lk,
                                                  want_kl ? pick(l_ref, k) : T(0), adv_k, w_is, rho);
          const T w = mk * row_factor;
          acc[kSlotLoss] += w * tt.loss;
          acc[kSlotMask] += mk;
          acc[kSlotKL] += mk * tt.kl;
          acc[kSlotLow] += tt.low * mk;
          acc[kSlotHigh] += tt.high * mk;
          acc[kSlotRegion] += (tt.low + tt.high) * mk;  // low and high never hold together
          acc[kSlotCispo] += tt.cispo_clipped * mk;
          if (vespo) acc[kSlotPhi] += phi * mk;
          if (p.sequence_level) {
            acc[kNumRowSlots] += w * (lone_row ? tt.token_drho : tt.dloss_drho);
            put(g, k, w * tt.token_dl);  // the paths through the row's ratio are added below
          } else {
            put(g, k, w * token_level_grad(tt, rho));
          }
        }
      }
      if (grad_row) store_row_tokens<T, K>(grad_row, n_cols, c, g);
    });
    double row_sum[kNumRowSlots + 1];  // acc summed over the block in double
#pragma unroll
    for (int s = 0; s <= kNumRowSlots; ++s) row_sum[s] = double(acc[s]);
    block_sum<double, kNumRowSlots + 1>(row_sum, scratch);
    if (threadIdx.x == 0) {
      if (p.row_share_metrics) set_row_clip_shares<T>(consts, seq_ratio, in.advantages.load<T>(row, 0), row_sum);
      row_sum[kSlotNonEmpty] = row_sum[kSlotMask] > 0.0 ? 1.0 : 0.0;
      if (vespo && p.per_row_advantages) {
        row_sum[kSlotPhi] = vespo_phi(consts, vespo_log_w, in.advantages.load<T>(row, 0));
      }
#pragma unroll
      for (int s = 0; s < kNumRowSlots; ++s) partials[row * kNumRowSlots + s] = row_sum[s];
    }
    if (grad_row && p.sequence_level) {
      // d s_i / d l[i,t] = s_i * m[i,t] / max(n_i, 1); each thread revisits only the tokens it wrote above.
      // With bias correction the KL's own path, rho * w * beta * dKL/dl, joins the row's factor of rho before the
      // product (an overflowed ratio gives the limit by the sum's sign, not inf - inf; docs/math.md section 8): the
      // token's l and l_ref are read again, in this configuration only.
      const bool own_kl_path = p.bias_correction && want_kl && !lone_row;  // a lone row's S holds it
      const T row_drho = T(row_sum[kNumRowSlots] / count_clamped);
      for_each_chunk<K>(n_cols, vector, head, [&](const TokenChunk& c) {
        T m[K], g[K];
        if (!load_mask(c, m)) return;
        load_row_tokens<T, K>(grad_row, n_cols, c, g);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (m[k] == T(0)) continue;
          T own = T(0);
          if (own_kl_path) {
            const int64_t t = c.token(k);
            own = m[k] * row_factor * kl_slope(consts, kl, in.logps.load<T>(row, t), in.ref_logps.load<T>(row, t));
          }
          g[k] += through_ratio_exp(m[k] * row_drho + own, seq_ratio);
        }
        store_row_tokens<T, K>(grad_row, n_cols, c, g);
      });
    }
  }
}

// The batch totals and the loss, metrics and gradient scale from them in double, as the CPU kernel computes them;
// each output rounded to T once.
template <typename T>
__global__ void __launch_bounds__(256)
    grpo_loss_finalize_kernel(LossParams p, const double* __restrict__ partials, int64_t batch,
                              int64_t max_completion_length, bool has_num_items, DeviceNumber<T> num_items,
                              DeviceNumber<T> loss_scale, T* loss_out, T* metrics_out, T* grad_scale_out) {
  __shared__ double scratch[kNumRowSlots * 32];
  double totals[kNumRowSlots];
#pragma unroll
  for (int s = 0; s < kNumRowSlots; ++s) totals[s] = 0.0;
  for (int64_t row = threadIdx.x; row < batch; row += blockDim.x) {
#pragma unroll
    for (int s = 0; s < kNumRowSlots; ++s) totals[s] += partials[row * kNumRowSlots + s];
  }
  block_sum<double, kNumRowSlots>(totals, scratch);
  if (threadIdx.x == 0) {
    double loss, metrics[kNumMetrics], grad_scale;
    finalize_loss<double>(p, totals, batch, max_completion_length, has_num_items, num_items.get(), loss_scale.get(),
                          &loss, metrics, &grad_scale);
    *loss_out = T(loss);
    *grad_scale_out = T(grad_scale);
#pragma unroll
    for (int s = 0; s < kNumMetrics; ++s) metrics_out[s] = T(metrics[s]);
  }
}

// grad_logps = grad_raw * (grad_loss * grad_scale), written in the logps dtype (rounded once, vector_io.cuh's to_out):
// 16-byte loads of grad_raw (4 float32 or 2 float64) and one store of as many elements, when both start on such a
// chunk (the allocator's tensors do); element by element otherwise.
template <typename T, typename Out>
__global__ void __launch_bounds__(256)
    grpo_loss_backward_kernel(const T* __restrict__ grad_raw, const T* __restrict__ grad_loss,
                              const T* __restrict__ grad_scale, Out* __restrict__ out, int64_t n) {
  constexpr int K = kVectorBytes / static_cast<int>(sizeof(T));
  const T factor = grad_loss[0] * grad_scale[0];
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(grad_raw) % sizeof(Pack<T, K>) == 0 &&
      reinterpret_cast<uintptr_t>(out) % sizeof(Pack<Out, K>) == 0) {
    done = n / K * K;
#pragma unroll 1  // one chunk per thread at the launcher's grid; unrolled, float32 took 34 registers (75% occupancy)
    for (int64_t i = first; i < n / K; i += stride) {
      const Pack<T, K> g = reinterpret_cast<const Pack<T, K>*>(grad_raw)[i];
      Pack<Out, K> result;
#pragma unroll
      for (int k = 0; k < K; ++k) result.v[k] = to_out<Out, T>(g.v[k] * factor);
      reinterpret_cast<Pack<Out, K>*>(out)[i] = result;
    }
  }
  for (int64_t i = done + first; i < n; i += stride) out[i] = to_out<Out, T>(grad_raw[i] * factor);
}

// Threads per row: enough for ~8 tokens each, a warp at least, 256 at most (__launch_bounds__).
inline int loss_threads_per_row(int64_t seq_len) {
  const int64_t want = (seq_len + 7) / 8;
  return round_up_to_warp(want < 32 ? 32 : (want > 256 ? 256 : want));
}

// `partials`: [batch, kNumRowSlots] float64 scratch whatever T (the row partials are summed in double).
template <typename T>
void launch_grpo_loss_forward(const LossParams& p, const LossInputs& in, int64_t max_completion_length,
                              bool has_num_items, DeviceNumber<T> num_items, DeviceNumber<T> loss_scale, T* grad,
                              double* partials, T* loss_out, T* metrics_out, T* grad_scale_out, cudaStream_t stream) {
  const int64_t max_blocks = int64_t(1) << 30;
  const unsigned blocks = static_cast<unsigned>(in.batch < max_blocks ? in.batch : max_blocks);
  GRPO_LAUNCH(blocks, loss_threads_per_row(in.seq_len), 0, stream, grpo_loss_rows_kernel<T>)(p, in, grad, partials);
  GRPO_LAUNCH(1, 256, 0, stream, grpo_loss_finalize_kernel<T>)(p, partials, in.batch, max_completion_length,
                                                               has_num_items, num_items, loss_scale, loss_out,
                                                               metrics_out, grad_scale_out);
}

template <typename T, typename Out>
void launch_grpo_loss_backward(const T* grad_raw, const T* grad_loss, const T* grad_scale, Out* out, int64_t n,
                               int num_sms, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t per_thread = kVectorBytes / sizeof(T), chunks = (n + per_thread - 1) / per_thread;  // one each
  int64_t blocks = (chunks + threads - 1) / threads;
  const int64_t cap = int64_t(num_sms) * 8;
  if (blocks > cap) blocks = cap;
  GRPO_LAUNCH(static_cast<unsigned>(blocks), threads, 0, stream, grpo_loss_backward_kernel<T, Out>)(grad_raw, grad_loss,
                                                                                                    grad_scale, out, n);
}

}  // namespace grpo_ext
