// CUDA kernels of the fused GRPO loss from logits, on raw pointers and a stream (no torch types).
//
// Token-level losses: a small one-block kernel turns the masks into per-row gradient weights (no host sync), then
// one block per logits row reads the row once (16-byte loads, vector_io.cuh) for its online softmax statistics,
// computes the token's log-prob, entropy and d loss / d logp (grpo_loss_math.h), and reads the row a second time to
// write the gradient g * (onehot - softmax) * dz/dx (docs/math.md section 2: temperature, logit_scale, logit_softcap).
// The second read follows the first within the same block, so it is served from L2 rather than HBM for rows up to a
// few MB; the logits never round-trip through an [N, V] float temporary. Sequence-level losses use the same kernel
// twice: once for the log-probs, once with the per-token gradients.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../grpo_loss_math.h"
#include "launch.cuh"
#include "reduce.cuh"
#include "selective_log_softmax.cuh"
#include "vector_io.cuh"

namespace grpo_ext {

// row_weight[b] = global scale * (1 / max(n_b, 1) for grpo/sapo, else 1). One block: a warp per row for n_b (a
// fixed shuffle tree), then a fixed block tree over the rows for the mask total.
template <typename T>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_row_weights_kernel(LossParams p, LossInputs in, int64_t max_completion_length,
                                             bool has_num_items, T num_items_value,
                                             const T* __restrict__ num_items_device, T loss_scale,
                                             T* __restrict__ row_weight) {
  __shared__ T scratch[2 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int64_t b = warp; b < in.batch; b += num_warps) {
    T count = T(0);
    for (int64_t t = lane; t < in.seq_len; t += 32) count += in.mask_at<T>(b, t);
    count = warp_sum(count);
    if (lane == 0) row_weight[b] = count;
  }
  __syncthreads();            // the counts are visible to the whole block
  T total[2] = {T(0), T(0)};  // the kept tokens, the rows with one
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    total[0] += row_weight[b];
    total[1] += row_weight[b] > T(0) ? T(1) : T(0);
  }
  block_sum<T, 2>(total, scratch);
  const T num_items = num_items_device ? num_items_device[0] : num_items_value;
  const T scale = global_loss_scale<T>(p, in.batch, max_completion_length, total[0], total[1], has_num_items, num_items,
                                       loss_scale);
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    row_weight[b] = logits_row_weight<T>(p.loss_type, row_weight[b], scale);
  }
}

struct LogitsPassArgs {
  LossParams params;
  LossInputs inputs;  // the [B, T] loss inputs; logps unused
  LogitsRows logits;
  StridedMatrix ids;         // [R, 1]
  StridedMatrix token_grad;  // [R, 1] or absent
  int64_t row_offset;
  bool compute_grad;
  bool grad_in_logits;  // the in-place op: row r's gradient goes over logits row r
};

// Up to 1024 threads per block (row_threads): the bound keeps even the float64 instantiation within the SM's
// 64K registers, where it would otherwise fail to launch.
template <typename T, typename In>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight, In* grad,
                                 T* __restrict__ logps, T* __restrict__ entropy) {
  __shared__ SoftmaxState<T> warp_states[32];
  __shared__ T row_max, row_log_sum, row_logp, row_g;
  __shared__ int64_t row_id;
  const LossParams& p = a.params;
  const LossInputs& in = a.inputs;
  const int64_t vocab = a.logits.vocab;
  const TokenConsts<T> consts(p);
  const PolicyFamily family = policy_family(p.loss_type);
  const KLKind kl = kl_kind(p);
  for (int64_t r = blockIdx.x; r < a.logits.rows; r += gridDim.x) {
    const int64_t n = a.row_offset + r, b = n / in.seq_len, t = n % in.seq_len;
    const T m = in.mask_at<T>(b, t);
    const In* x = static_cast<const In*>(a.logits.data) + a.logits.offset(r);
    // Not __restrict__: in the in-place op this is x itself (each element is read before it is overwritten, by
    // the thread that writes it).
    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + a.logits.offset(r) : grad + r * vocab) : nullptr;
    if (m == T(0)) {  // never read; a zero gradient
      if (grad_row) fill_row(grad_row, vocab, to_out<In, T>(T(0)));
      if (threadIdx.x == 0) {
        logps[r] = T(0);
        entropy[r] = T(0);
      }
      continue;
    }
    SoftmaxState<T> s{T(0), T(0), T(0)};
    for_each_in_row<T>(x, vocab, [&](int64_t, T logit) { s = add_logit(s, f(logit)); });
    s = block_merge(s, warp_states);
    if (threadIdx.x == 0) {
      const int64_t id = a.ids.load<int64_t>(r, 0);
      CUDA_KERNEL_ASSERT(id >= 0 && id < vocab);
      // Relative to the max (see selective_log_softmax_forward_kernel): exact for confident tokens.
      const T log_sum = log(s.sum);
      const T logp = (f(load_as<T>(x + id)) - s.max) - log_sum;
      logps[r] = logp;
      entropy[r] = log_sum - s.weighted / s.sum;
      T g = T(0);
      if (grad_row) {
        if (a.token_grad.present()) {
          g = a.token_grad.load<T>(r, 0);
        } else {
          const T l_old = p.has_old ? in.old_logps.load<T>(b, t) : logp;
          const T l_ref = p.beta != 0.0 ? in.ref_logps.load<T>(b, t) : T(0);
          const T isw = in.is_weights.present() ? in.is_weights.load<T>(b, t) : T(1);
          g = row_weight[b] * m *
              token_logp_grad<T>(consts, family, kl, p.bias_correction, p.has_old, logp, l_old, l_ref,
                                 in.advantages.load<T>(b, t), isw);
        }
      }
      row_max = s.max;
      row_log_sum = log_sum;
      row_logp = logp;
      row_g = g;
      row_id = id;
    }
    __syncthreads();
    if (grad_row) {
      const T z_max = row_max, log_sum = row_log_sum, g = row_g;
      const int64_t id = row_id;
      // d/dz_v of g * logp = g * (onehot - p_v), times dz/dx; the chosen entry as -expm1(logp), exact where p -> 1.
      const T chosen = -g * expm1(row_logp);
      transform_row<T>(x, grad_row, vocab, [&](int64_t v, T logit) {
        const T z = f(logit);
        const T value = v == id ? chosen : -g * exp((z - z_max) - log_sum);
        return value * f.slope_at(z);
      });
    }
    __syncthreads();  // the shared row values are reused by the next row
  }
}

// x *= factor[0] over the rows of a [R, V] (row-strided) gradient, unless the factor is exactly 1: every block
// reads the factor and returns at once, so a backward with grad_output == 1 costs a launch and no pass over memory.
template <typename T, typename Out>
__global__ void __launch_bounds__(256) scale_rows_kernel(LogitsRows rows, const T* __restrict__ factor) {
  const T f = factor[0];
  if (f == T(1)) return;
  Out* base = static_cast<Out*>(const_cast<void*>(rows.data));
  for (int64_t r = blockIdx.y; r < rows.rows; r += gridDim.y) {
    Out* row = base + rows.offset(r);
    for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < rows.vocab;
         v += int64_t(gridDim.x) * blockDim.x) {
      row[v] = to_out<Out, T>(load_as<T>(row + v) * f);
    }
  }
}

template <typename T>
void launch_grpo_loss_from_logits_row_weights(const LossParams& p, const LossInputs& in, int64_t max_completion_length,
                                              bool has_num_items, T num_items_value, const T* num_items_device,
                                              T loss_scale, T* row_weight, cudaStream_t stream) {
  GRPO_LAUNCH(1, 1024, 0, stream, grpo_loss_from_logits_row_weights_kernel<T>)(
      p, in, max_completion_length, has_num_items, num_items_value, num_items_device, loss_scale, row_weight);
}

template <typename T, typename In>
void launch_grpo_loss_from_logits(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight, In* grad,
                                  T* logps, T* entropy, cudaStream_t stream) {
  if (a.logits.rows == 0) return;
  const int64_t max_blocks = int64_t(1) << 30;  // grid-stride beyond that: any number of rows
  const unsigned blocks = static_cast<unsigned>(a.logits.rows < max_blocks ? a.logits.rows : max_blocks);
  GRPO_LAUNCH(blocks, row_threads(a.logits.vocab, sizeof(In)), 0, stream, grpo_loss_from_logits_kernel<T, In>)(
      a, f, row_weight, grad, logps, entropy);
}

template <typename T, typename Out>
void launch_scale_rows(const LogitsRows& rows, const T* factor, cudaStream_t stream) {
  if (rows.rows == 0) return;
  const int threads = 256;
  int64_t x_blocks = (rows.vocab + threads - 1) / threads;
  if (x_blocks > 64) x_blocks = 64;
  const int64_t y_blocks = rows.rows < 65535 ? rows.rows : 65535;
  GRPO_LAUNCH(dim3(unsigned(x_blocks), unsigned(y_blocks)), threads, 0, stream, scale_rows_kernel<T, Out>)(rows,
                                                                                                           factor);
}

}  // namespace grpo_ext
