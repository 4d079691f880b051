// CUDA kernels of the fused GRPO loss from logits, on raw pointers and a stream (no torch types).
//
// Token-level losses: a small one-block kernel turns the masks into per-row gradient weights (no host sync), then
// the pass computes each row's online softmax statistics (16-byte loads, vector_io.cuh), the token's log-prob,
// entropy and d loss / d logp (grpo_loss_math.h), and writes the gradient g * (onehot - softmax) * dz/dx (docs/math.md
// section 2: temperature, logit_scale, logit_softcap). Two kernels share that per-row code (finish_row,
// write_row_grad: grpo_loss_from_logits_row.cuh): the single-read one (grpo_loss_from_logits_single_read.cuh), for
// rows that fit on chip, stages each row in shared memory, split over a thread-block cluster when one block cannot
// hold it (cluster.cuh), and reads HBM once; the two-read one (here), for any row, reads it again to write the
// gradient. The logits never round-trip through an [N, V] float temporary. Sequence-level losses run the pass twice:
// for the log-probs, then with the per-token gradients. This file: the row weights, the two-read kernel, and the
// launcher that picks the pass's kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../logits_loss_math.h"
#include "grpo_loss_from_logits_row.cuh"
#include "grpo_loss_from_logits_single_read.cuh"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// row_weight[b] = global scale * (1 / max(n_b, 1) for grpo/sapo, else 1), and row_weight[B] = the entropy bonus'
// entropy_coef * loss_scale / max(sum m * w, 1) (w: entropy_weights, 1 when absent). One block: a warp per row for
// n_b (a fixed shuffle tree), then a fixed block tree over the rows for the mask totals. The totals, the scale and
// each weight in double, rounded to T once, as the CPU kernel does.
template <typename T>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_row_weights_kernel(LossParams p, LossInputs in, int64_t max_completion_length,
                                             bool has_num_items, DeviceNumber<T> num_items, DeviceNumber<T> loss_scale,
                                             T entropy_coef, StridedMatrix entropy_weights,
                                             T* __restrict__ row_weight) {
  __shared__ double scratch[3 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  double weighted = 0.0;  // this thread's part of sum m * w (only with entropy_weights): tokens of many rows
  for (int64_t b = warp; b < in.batch; b += num_warps) {
    T count = T(0);
    for (int64_t t = lane; t < in.seq_len; t += 32) {
      const T m = in.mask_at<T>(b, t);
      count += m;
      if (entropy_weights.present()) weighted += double(entropy_weight_at(m, entropy_weights, b, t));
    }
    count = warp_sum(count);
    if (lane == 0) row_weight[b] = count;
  }
  __syncthreads();                         // the counts are visible to the whole block
  double total[3] = {0.0, 0.0, weighted};  // the kept tokens, the rows with one, sum m * w
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    total[0] += row_weight[b];
    total[1] += row_weight[b] > T(0) ? 1.0 : 0.0;
  }
  block_sum<double, 3>(total, scratch);
  const double scale = global_loss_scale<double>(p, in.batch, max_completion_length, total[0], total[1], has_num_items,
                                                 num_items.get(), loss_scale.get());
  if (threadIdx.x == 0) {  // before the rows' loop: so ordered, the float kernel fits 32 registers, no spill
    row_weight[in.batch] = T(entropy_row_weight<double>(double(entropy_coef), loss_scale.get(),
                                                        entropy_weights.present() ? total[2] : total[0]));
  }
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    row_weight[b] = T(logits_row_weight<double>(p.loss_type, double(row_weight[b]), scale));
  }
}

// The two-read pass, for any row: each block over rows, a row's statistics from one read, its gradient from a second
// (from L2 if the row is still there). Two kernels run it (below): the same code under two register budgets.
template <typename T, typename In>
__device__ __forceinline__ void two_read_pass(const LogitsPassArgs& a, const LogitTransform<T>& f,
                                              const T* __restrict__ row_weight, In* grad, T* __restrict__ logps,
                                              T* __restrict__ entropy, PassShared<T>& sh) {
  const int64_t vocab = a.logits.vocab;
  for (int64_t r = blockIdx.x; r < a.logits.rows; r += gridDim.x) {
    const PassRow<T> row = pass_row<T>(a, r);
    const In* x = static_cast<const In*>(a.logits.data) + a.logits.offset(r);
    // Not __restrict__: in the in-place op this is x itself (each element is read before it is overwritten, by
    // the thread that writes it).
    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + a.logits.offset(r) : grad + r * vocab) : nullptr;
    if (row.m == T(0)) {  // never read; a zero gradient
      if (grad_row) fill_row(grad_row, vocab, to_out<In, T>(T(0)));
      if (threadIdx.x == 0) {
        logps[r] = T(0);
        entropy[r] = T(0);
      }
      continue;
    }
    SoftmaxState<T> s;
    with_soft_cap(f, [&](auto cap) { s = row_state<decltype(cap)::value>(f, x, vocab); });
    s = block_merge(s, sh.warp_states);
    if (threadIdx.x == 0) {
      finish_row(a, f, row_weight, chosen_token<T>(a, x, r), s, row, grad_row != nullptr, true, logps, entropy, sh);
    }
    __syncthreads();
    // The second read of the row, from L2 if it is still there.
    if (grad_row)
      with_soft_cap(f, [&](auto cap) { write_row_grad<decltype(cap)::value>(f, sh, x, grad_row, 0, vocab); });
    __syncthreads();  // the shared row values are reused by the next row
  }
}

// The two-read kernel: up to 1024 threads per block (row_threads); the bound keeps even the float64 instantiation
// within the SM's 64K registers, where it would otherwise fail to launch. nvcc gives the bf16/fp16 one 64 registers
// a thread: 4 blocks of 256 threads an SM, 50% occupancy.
template <typename T, typename In>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight, In* grad,
                                 T* __restrict__ logps, T* __restrict__ entropy) {
  __shared__ PassShared<T> sh;
  two_read_pass(a, f, row_weight, grad, logps, entropy, sh);
}

// The same pass in blocks of at most 256 threads, 8 of them resident per SM: 32 registers a thread, 100% occupancy
// and twice the loads in flight (64 KiB an SM), without spills for bf16 and fp16 logits (ptxas on sm_90; float32
// spills at 32 and is never launched here). A layout candidate (GRPO_EXT_LOGITS_FULL_OCCUPANCY=1,
// with_layout_from_env): the fifth session's ncu run had the two-read kernel at 50% occupancy and 75% of the H200's
// DRAM peak, where 3 TB/s at about 1 us of latency already needs 22 KiB in flight per SM and 4.8 TB/s 36 KiB.
template <typename T, typename In>
__global__ void __launch_bounds__(256, 8)
    grpo_loss_from_logits_full_occupancy_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight,
                                                In* grad, T* __restrict__ logps, T* __restrict__ entropy) {
  __shared__ PassShared<T> sh;
  two_read_pass(a, f, row_weight, grad, logps, entropy, sh);
}

// x *= factor[0] over the rows of a [R, V] (row-strided) gradient, unless the factor is exactly 1: every block
// reads the factor and returns at once, so a backward with grad_output == 1 costs a launch and no pass over memory.
// One block per row, 16-byte accesses (rows are contiguous).
template <typename T, typename Out>
__global__ void __launch_bounds__(1024) scale_rows_kernel(LogitsRows rows, const T* __restrict__ factor) {
  const T f = factor[0];
  if (f == T(1)) return;
  Out* base = static_cast<Out*>(const_cast<void*>(rows.data));
  for (int64_t r = blockIdx.x; r < rows.rows; r += gridDim.x) {
    Out* row = base + rows.offset(r);
    transform_row<T>(row, row, rows.vocab, [&](int64_t, T v) { return v * f; });
  }
}

template <typename T>
void launch_grpo_loss_from_logits_row_weights(const LossParams& p, const LossInputs& in, int64_t max_completion_length,
                                              bool has_num_items, DeviceNumber<T> num_items, DeviceNumber<T> loss_scale,
                                              T entropy_coef, const StridedMatrix& entropy_weights, T* row_weight,
                                              cudaStream_t stream) {
  GRPO_LAUNCH(1, 1024, 0, stream, grpo_loss_from_logits_row_weights_kernel<T>)(
      p, in, max_completion_length, has_num_items, num_items, loss_scale, entropy_coef, entropy_weights, row_weight);
}

// Threads per block of the two-read kernel: row_threads, at most device.max_threads (two_read_threads when 0).
inline int pass_threads(int64_t vocab, int element_bytes, const RowResidency& device) {
  const int threads = row_threads(vocab, element_bytes);
  const int cap = device.max_threads > 0 ? device.max_threads : two_read_threads(element_bytes);
  return threads < cap ? threads : cap;
}

// The pass over every row: the single-read (small-block) kernel where device.max_cluster_blocks > 0, a row fits 16
// blocks and the device runs such a cluster, else (or if the device refuses that launch) the two-read kernel (its
// full-occupancy build where device.full_occupancy asks for it and the logits are bf16/fp16 in blocks of <= 256).
template <typename T, typename In>
void launch_grpo_loss_from_logits(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight, In* grad,
                                  T* logps, T* entropy, const RowResidency& device, cudaStream_t stream) {
  if (a.logits.rows == 0) return;
  if (device.max_cluster_blocks > 0) {
    if (launch_small_blocks<T, In>(a, f, row_weight, grad, logps, entropy, device, stream)) return;
    (void)cudaGetLastError();  // too long a row, or refused: clear any error and take the two-read pass
  }
  const int64_t max_rows = int64_t(1) << 27;  // grid-stride beyond that: any number of rows
  const int64_t rows = a.logits.rows < max_rows ? a.logits.rows : max_rows;
  const int threads = pass_threads(a.logits.vocab, sizeof(In), device);
  if constexpr (std::is_same_v<T, float> && sizeof(In) == 2) {  // bf16/fp16 logits: the 32-register candidate
    if (device.full_occupancy && threads <= 256) {
      GRPO_LAUNCH(unsigned(rows), threads, 0, stream, grpo_loss_from_logits_full_occupancy_kernel<T, In>)(
          a, f, row_weight, grad, logps, entropy);
      return;
    }
  }
  GRPO_LAUNCH(unsigned(rows), threads, 0, stream, grpo_loss_from_logits_kernel<T, In>)(a, f, row_weight, grad, logps,
                                                                                       entropy);
}

template <typename T, typename Out>
void launch_scale_rows(const LogitsRows& rows, const T* factor, cudaStream_t stream) {
  if (rows.rows == 0) return;
  const int64_t max_rows = int64_t(1) << 27;
  GRPO_LAUNCH(unsigned(rows.rows < max_rows ? rows.rows : max_rows), row_threads(rows.vocab, sizeof(Out)), 0, stream,
              scale_rows_kernel<T, Out>)(rows, factor);
}

}  // namespace grpo_ext
