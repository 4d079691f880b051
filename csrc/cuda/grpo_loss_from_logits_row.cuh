// The per-row code of the fused GRPO loss from logits that both pass kernels share (grpo_loss_from_logits.cuh: the
// two-read kernel; grpo_loss_from_logits_single_read.cuh: the single-read one), on raw pointers: the pass's
// arguments, a row's place in the loss, its log-prob, entropy and d loss / d logp from its softmax state
// (finish_row), its gradient loop (write_row_grad), and what the device offers and the environment picks for the
// pass's layout (RowResidency, with_layout_from_env).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "../logits_loss_math.h"
#include "selective_log_softmax.cuh"
#include "vector_io.cuh"

namespace grpo_ext {

struct LogitsPassArgs {
  LossParams params;
  LossInputs inputs;  // the [B, T] loss inputs; logps unused
  LogitsRows logits;
  StridedMatrix ids;         // [R, 1]
  StridedMatrix token_grad;  // [R, 1] or absent
  int64_t row_offset;
  bool compute_grad;
  bool grad_in_logits;            // the in-place op: row r's gradient goes over logits row r
  bool entropy_bonus;             // the gradient has the entropy bonus' term (its weight is row_weight[B])
  StridedMatrix entropy_weights;  // [B, T] weights of the tokens in the bonus' mean, or absent (every kept token)
};

// The shared memory of both pass kernels' per-row work.
template <typename T>
struct PassShared {
  SoftmaxState<T> warp_states[32];
  T row_max, row_log_sum, row_g;
  T row_entropy_weight, row_mean_shift;  // the entropy bonus' e * m and E_p[z] - max
  T row_chosen_grad;                     // the chosen token's entry of the gradient
  int64_t row_id;
};

// A logits row's place in the loss: its output index r, its token (b, t) and that token's mask value m.
template <typename T>
struct PassRow {
  int64_t r, b, t;
  T m;
};

template <typename T>
__device__ __forceinline__ PassRow<T> pass_row(const LogitsPassArgs& a, int64_t r) {
  const int64_t n = a.row_offset + r, b = n / a.inputs.seq_len, t = n % a.inputs.seq_len;
  return {r, b, t, a.inputs.mask_at<T>(b, t)};
}

// The row's chosen token and its raw logit, read by thread 0 before any block writes over the row (the in-place
// op).
template <typename T>
struct ChosenToken {
  int64_t id;
  T logit;
};

template <typename T, typename In>
__device__ __forceinline__ ChosenToken<T> chosen_token(const LogitsPassArgs& a, const In* x, int64_t r) {
  const int64_t id = a.ids.load<int64_t>(r, 0);
  CUDA_KERNEL_ASSERT(id >= 0 && id < a.logits.vocab);
  return {id, load_as<T>(x + id)};
}

// Thread 0 of a block, once the row's softmax state `s` is known: the log-prob, the entropy (written when
// `write_outputs`) and d loss / d logp, shared with the block for the gradient, with the chosen token's entry of it.
template <typename T>
__device__ __forceinline__ void finish_row(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight,
                                           const ChosenToken<T>& chosen, const SoftmaxState<T>& s,
                                           const PassRow<T>& row, bool with_grad, bool write_outputs, T* logps,
                                           T* entropy, PassShared<T>& sh) {
  const LossParams& p = a.params;
  const LossInputs& in = a.inputs;
  // Relative to the max (see selective_log_softmax_forward_kernel): exact for confident tokens. d as the row's
  // statistics and gradient loop take it (LogitTransform::d_with).
  const T log_sum = log(s.sum), d = f.d_at(chosen.logit, s.max);
  const T logp = d - log_sum;
  if (write_outputs) {
    logps[row.r] = logp;
    entropy[row.r] = log_sum - s.weighted / s.sum;
  }
  T g = T(0);
  if (with_grad) {
    if (a.token_grad.present()) {
      g = a.token_grad.load<T>(row.r, 0);
    } else {
      const T l_old = p.has_old ? in.old_logps.load<T>(row.b, row.t) : logp;
      const T l_ref = p.beta != 0.0 ? in.ref_logps.load<T>(row.b, row.t) : T(0);
      const T isw = (in.is_weights.present() ? in.is_weights.load<T>(row.b, row.t) : T(1)) *
                    (in.policy_weights.present() ? in.policy_weights.load<T>(row.b, row.t) : T(1));
      g = row_weight[row.b] * row.m *
          token_logp_grad<T>(TokenConsts<T>(p), policy_family(p.loss_type), kl_kind(p), p.bias_correction, p.has_old,
                             logp, l_old, l_ref, in.advantages.load<T>(row.b, row.t), isw);
    }
  }
  sh.row_max = s.max;
  sh.row_log_sum = log_sum;
  sh.row_g = g;
  T entropy_weight = T(0);
  if (with_grad && a.entropy_bonus) {
    entropy_weight = row_weight[in.batch] * entropy_weight_at(row.m, a.entropy_weights, row.b, row.t);
  }
  const T mean_shift = s.weighted / s.sum;
  sh.row_entropy_weight = entropy_weight;
  sh.row_mean_shift = mean_shift;
  // g * (1 - p) * dz/dx as -g * expm1(logp) (exact where p -> 1), with the bonus's term as every entry has it
  T chosen_grad = -g * expm1(logp);
  if (entropy_weight != T(0)) {
    chosen_grad += entropy_weight * softmax_exp(logp) * (fmax(d, std::numeric_limits<T>::lowest()) - mean_shift);
  }
  sh.row_chosen_grad = chosen_grad * f.slope_at(f(chosen.logit));
  sh.row_id = chosen.id;
}

// out[v] = d/dx_v of g * logp for the row's elements [lo, lo + n) read from `x` (the row at `x - lo`):
// g * (onehot - p_v) * dz/dx, with the entropy bonus plus e * p_v * (z_v - E_p[z]) (0 where p_v = 0, a -inf logit
// included). The loop writes -g * p_v (and the bonus's term) for every element, the chosen one included: no compare
// and select an element. Then the thread that wrote the chosen entry writes it again, as finish_row computed it
// (row_chosen_grad). Without a cap dz/dx is a constant, folded into the row's factors, and d = z - max is one FMA
// of the raw logit (d_with, as the statistics took it): two instructions an element fewer.
template <SoftCap kCap, bool kEntropy, typename T, typename In>
__device__ __forceinline__ void write_row_grad_with(const LogitTransform<T>& f, const PassShared<T>& sh, const In* x,
                                                    In* out, int64_t lo, int64_t n) {
  const T z_max = sh.row_max, g = sh.row_g, e = sh.row_entropy_weight, mean_shift = sh.row_mean_shift;
  const ShiftedExp<T> p_of(sh.row_log_sum);  // p = exp(d - log_sum)
  constexpr bool kConstantSlope = kCap == SoftCap::kOff;
  const T slope = kConstantSlope ? f.slope : T(1);
  const T minus_g = -g * slope, e_slope = e * slope;
  transform_row<T>(x, out, n, [&](int64_t, T logit) {
    const T d = f.template d_with<kCap>(logit, z_max);  // as the statistics took it: one FMA without a cap
    const T p = p_of(d);
    T value = p * minus_g;
    // p * (d - E_p[z] + max) with no branch: where p = 0 (a -inf logit, d = -inf) d is taken as the lowest float,
    // so the term is 0 * finite = 0, never 0 * -inf; a NaN p stays NaN.
    if constexpr (kEntropy) value = fma(e_slope * p, (fmax(d, std::numeric_limits<T>::lowest()) - mean_shift), value);
    if constexpr (!kConstantSlope) value *= f.template slope_with<kCap>(f.template z_with<kCap>(logit));  // d's z
    return value;
  });
  const int64_t id = sh.row_id - lo;
  if (id >= 0 && id < n && writes_element(x, n, id)) out[id] = to_out<In, T>(sh.row_chosen_grad);
}
// The row's gradient loop with the entropy bonus' term compiled in only where the row has one (a uniform branch).
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ void write_row_grad(const LogitTransform<T>& f, const PassShared<T>& sh, const In* x,
                                               In* out, int64_t lo, int64_t n) {
  if (sh.row_entropy_weight != T(0)) {
    write_row_grad_with<kCap, true>(f, sh, x, out, lo, n);
  } else {
    write_row_grad_with<kCap, false>(f, sh, x, out, lo, n);
  }
}

// What the device offers the single-read pass: dynamic shared memory per block (the device's opt-in maximum) and per
// SM, and the largest cluster (16 on sm_90 and newer: the non-portable size; 1 before; 0: the two-read pass only).
// And the layout on the SM: threads per block of the two-read kernel at most max_threads (0: two_read_threads), and
// whether the single-read kernel's clusters are persistent.
struct RowResidency {
  size_t shared_per_block = 0;
  size_t shared_per_sm = 0;
  unsigned max_cluster_blocks = 0;
  int max_threads = 0;
  bool persistent_clusters = false;  // as many clusters as run at once, each over several rows
  bool full_occupancy = false;       // the two-read kernel's 32-register build (bf16/fp16, blocks of <= 256)
};

// The layout candidates of issues 32 and 38, chosen at run time so that one GPU session compares them all (read at
// each call; anything else keeps the default). The default is the two-read kernel for every row: on an H100 and an
// H200 it was faster than every single-read layout measured (2026-11-26/27, benchmarks/RESULTS.md), so the
// single-read pass waits behind GRPO_EXT_LOGITS_SINGLE_READ=1 (or small-blocks, its earlier name) until it wins: the
// small-block layout (small_block_layout: clusters of up to 16 blocks of 256 threads, four blocks of four rows per
// SM) where a row fits, else the two-read kernel. The resident layout (one block of up to 1024 threads an SM, its
// part of the row up to 227 KiB, clusters of up to 8) is gone: it lost to the two-read pass on all five shapes of
// both H100 calls and to the small blocks on every shape of both H200 calls (benchmarks/NOTES.md, "The resident
// single-read kernel removed"). The two-read kernel takes blocks of at most 256 threads for bf16/fp16 logits and 512
// for float32 (two_read_threads; its 55-64 registers a thread allow 1024 threads an SM): on an H200, 512 was 3.5-25%
// faster than one block of 1024 per SM on four of bench_floor's five shapes and level on the fifth, since one block
// of 1024 leaves the SM idle while it finishes a row; 256 was 2-5% faster than 512 on three bf16 shapes, level on
// the fourth, 2.5% slower on float32 (2026-11-27, RESULTS.md, both H200 sections).
// GRPO_EXT_LOGITS_THREADS=128|256|512|1024 sets the two-read kernel's block size, and 128 the small blocks' too.
// GRPO_EXT_LOGITS_PERSISTENT=1 launches the small-block layout with no more clusters than the device runs at once
// (cudaOccupancyMaxActiveClusters), each over several rows: one cluster placed per row was one candidate cause of that
// layout's time on an H200 (benchmarks/NOTES.md, "The small-block layout on an H200").
// GRPO_EXT_LOGITS_FULL_OCCUPANCY=1 runs bf16/fp16 rows of the two-read pass in its 32-register build, 8 blocks of 256
// threads an SM (grpo_loss_from_logits_full_occupancy_kernel), where its blocks are 256 threads or fewer.
// The two-read kernel's default block size (above) for logits of `element_bytes`: 256 threads for bf16/fp16, 512 for
// float32 and wider. max_threads == 0 (RowResidency) asks for it.
constexpr int two_read_threads(int element_bytes) {
  return element_bytes <= 2 ? 256 : 512;
}

inline RowResidency with_layout_from_env(RowResidency device) {
  const char* single_read = std::getenv("GRPO_EXT_LOGITS_SINGLE_READ");
  const bool wanted =
      single_read != nullptr && (std::strcmp(single_read, "1") == 0 || std::strcmp(single_read, "small-blocks") == 0);
  if (!wanted) device.max_cluster_blocks = 0;
  if (const char* threads = std::getenv("GRPO_EXT_LOGITS_THREADS")) {
    if (std::strcmp(threads, "128") == 0) device.max_threads = 128;
    if (std::strcmp(threads, "256") == 0) device.max_threads = 256;
    if (std::strcmp(threads, "512") == 0) device.max_threads = 512;
    if (std::strcmp(threads, "1024") == 0) device.max_threads = 1024;
  }
  const char* persistent = std::getenv("GRPO_EXT_LOGITS_PERSISTENT");
  device.persistent_clusters = persistent != nullptr && std::strcmp(persistent, "1") == 0;
  const char* full = std::getenv("GRPO_EXT_LOGITS_FULL_OCCUPANCY");
  device.full_occupancy = full != nullptr && std::strcmp(full, "1") == 0;
  return device;
}

}  // namespace grpo_ext
