// CPU kernels of the fused GRPO loss: rows in parallel (at::parallel_for), each row in a fixed sequential order,
// row partials summed in row order, so results are bitwise reproducible whatever the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../binding_utils.h"

namespace grpo_ext {
namespace {

// A row of a strided input as contiguous T: the data itself when it already is, else converted into `buffer`.
// Hoisting the dtype switch out of the token loop is what keeps that loop cheap.
template <typename T>
const T* row_values(const StridedMatrix& m, int64_t row, int64_t n, T* buffer) {
  if (!m.present()) return nullptr;
  constexpr DType kSame = sizeof(T) == sizeof(double) ? DType::kFloat64 : DType::kFloat32;
  if (m.dtype == kSame && m.col_stride == 1) return static_cast<const T*>(m.data) + row * m.row_stride;
  if (m.col_stride == 0) {
    const T v = m.load<T>(row, 0);
    for (int64_t t = 0; t < n; ++t) buffer[t] = v;
    return buffer;
  }
  switch (m.dtype) {  // one switch per row; each loop below vectorizes
#define GRPO_CONVERT_ROW(tag, ctype, expr)                                          \
  case DType::tag: {                                                              \
    const ctype* src = static_cast<const ctype*>(m.data) + row * m.row_stride;   \
    for (int64_t t = 0; t < n; ++t) {                                             \
      const ctype x = src[t * m.col_stride];                                      \
      buffer[t] = static_cast<T>(expr);                                           \
    }                                                                             \
    return buffer;                                                                \
  }
    GRPO_CONVERT_ROW(kFloat32, float, x)
    GRPO_CONVERT_ROW(kFloat64, double, x)
    GRPO_CONVERT_ROW(kBFloat16, uint16_t, bf16_bits_to_float(x))
    GRPO_CONVERT_ROW(kFloat16, uint16_t, f16_bits_to_float(x))
    GRPO_CONVERT_ROW(kBool, uint8_t, x)
    GRPO_CONVERT_ROW(kUInt8, uint8_t, x)
    GRPO_CONVERT_ROW(kInt8, int8_t, x)
    GRPO_CONVERT_ROW(kInt32, int32_t, x)
    GRPO_CONVERT_ROW(kInt64, int64_t, x)
#undef GRPO_CONVERT_ROW
  }
  return buffer;
}

// Per-thread scratch rows for the inputs that need converting.
template <typename T>
struct RowScratch {
  std::vector<T> mask, logps, old_logps, ref_logps, advantages, is_weights;
  explicit RowScratch(int64_t n)
      : mask(n), logps(n), old_logps(n), ref_logps(n), advantages(n), is_weights(n) {}
};

// One row: its loss/metric partials and, if requested, the raw gradient (before the global scale).
template <typename T>
void loss_row(const LossParams& p, const LossInputs& in, int64_t row, RowScratch<T>& scratch, double* partials,
              T* grad_row) {
  using std::exp;
  const int64_t n_cols = in.seq_len;
  const bool want_kl = p.beta != 0.0;
  // m_eff = mask * sample_mask: a dropped row reads nothing else.
  const T row_keep = in.sample_mask.present() ? in.sample_mask.load<T>(row, 0) : T(1);
  if (row_keep == T(0)) {
    if (grad_row) std::fill(grad_row, grad_row + n_cols, T(0));
    for (int s = 0; s < kNumRowSlots; ++s) partials[s] = 0.0;
    if (p.row_share_metrics) {  // every row counts in the row shares; a row without tokens has ratio 1
      bool low, high, cispo;
      clip_flags<T>(p, T(1), in.advantages.load<T>(row, 0), &low, &high, &cispo);
      partials[kSlotLow] = low;
      partials[kSlotHigh] = high;
      partials[kSlotRegion] = low || high;
      partials[kSlotCispo] = cispo;
    }
    return;
  }
  const T* mask = row_values(in.mask, row, n_cols, scratch.mask.data());
  const T* logps = row_values(in.logps, row, n_cols, scratch.logps.data());
  const T* old_logps = p.has_old ? row_values(in.old_logps, row, n_cols, scratch.old_logps.data()) : nullptr;
  const T* ref_logps = want_kl ? row_values(in.ref_logps, row, n_cols, scratch.ref_logps.data()) : nullptr;
  const T* advantages = row_values(in.advantages, row, n_cols, scratch.advantages.data());
  const T* is_weights = row_values(in.is_weights, row, n_cols, scratch.is_weights.data());

  const bool need_count = per_row_normalized(p.loss_type) || p.sequence_level;
  double count = 0.0, log_ratio_sum = 0.0;
  if (need_count) {
    for (int64_t t = 0; t < n_cols; ++t) {
      const T m = mask[t] * row_keep;
      if (m == T(0)) continue;
      count += m;
      if (p.sequence_level && old_logps) log_ratio_sum += double(m) * double(logps[t] - old_logps[t]);
    }
  }
  const double count_clamped = count > 1.0 ? count : 1.0;
  const T seq_ratio = p.sequence_level ? T(exp(log_ratio_sum / count_clamped)) : T(1);
  const T row_factor = per_row_normalized(p.loss_type) ? T(1.0 / count_clamped) : T(1);

  double acc[kNumRowSlots] = {0, 0, 0, 0, 0, 0, 0};
  double drho_sum = 0.0;  // sequence level: sum_t w * dP/drho
  for (int64_t t = 0; t < n_cols; ++t) {
    const T m = mask[t] * row_keep;
    if (m == T(0)) {
      if (grad_row) grad_row[t] = T(0);
      continue;
    }
    const T l = logps[t];
    const T rho = p.sequence_level ? seq_ratio : (old_logps ? exp(l - old_logps[t]) : T(1));
    const T adv = advantages[t];
    const T l_ref = ref_logps ? ref_logps[t] : T(0);
    const T isw = is_weights ? is_weights[t] : T(1);
    const TokenTerms<T> tt = token_terms<T>(p, l, l_ref, adv, isw, rho);
    const T w = m * row_factor;
    acc[kSlotLoss] += double(w * tt.loss);
    acc[kSlotMask] += double(m);
    acc[kSlotKL] += double(m * tt.kl);
    acc[kSlotLow] += tt.low ? double(m) : 0.0;
    acc[kSlotHigh] += tt.high ? double(m) : 0.0;
    acc[kSlotRegion] += (tt.low || tt.high) ? double(m) : 0.0;
    acc[kSlotCispo] += tt.cispo_clipped ? double(m) : 0.0;
    if (grad_row) {
      if (p.sequence_level) {
        drho_sum += double(w * tt.dloss_drho);
        grad_row[t] = w * tt.dloss_dl;
      } else {
        grad_row[t] = w * (tt.dloss_dl + tt.dloss_drho * rho);
      }
    }
  }
  if (p.row_share_metrics) {  // one condition per row, every row counted
    bool low, high, cispo;
    clip_flags<T>(p, seq_ratio, in.advantages.load<T>(row, 0), &low, &high, &cispo);
    acc[kSlotLow] = low;
    acc[kSlotHigh] = high;
    acc[kSlotRegion] = low || high;
    acc[kSlotCispo] = cispo;
  }
  if (grad_row && p.sequence_level) {
    // d s_i / d l[i,t] = s_i * m[i,t] / max(n_i, 1)
    const T through_ratio = T(drho_sum * double(seq_ratio) / count_clamped);
    for (int64_t t = 0; t < n_cols; ++t) {
      if (mask[t] != T(0)) grad_row[t] += through_ratio * mask[t] * row_keep;
    }
  }
  for (int s = 0; s < kNumRowSlots; ++s) partials[s] = acc[s];
}

template <typename T>
void loss_forward_cpu_impl(LossForwardPlan& plan) {
  const LossInputs& in = plan.inputs;
  const LossParams& p = plan.params;
  std::vector<double> partials(static_cast<size_t>(in.batch) * kNumRowSlots);
  T* grad = p.compute_grad ? plan.grad_raw.data_ptr<T>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(in.seq_len, 1));
  at::parallel_for(0, in.batch, grain, [&](int64_t begin, int64_t end) {
    RowScratch<T> scratch(in.seq_len);
    for (int64_t row = begin; row < end; ++row) {
      loss_row<T>(p, in, row, scratch, partials.data() + row * kNumRowSlots,
                  grad ? grad + row * in.seq_len : nullptr);
    }
  });
  double totals[kNumRowSlots] = {0, 0, 0, 0, 0, 0, 0};
  for (int64_t row = 0; row < in.batch; ++row) {
    for (int s = 0; s < kNumRowSlots; ++s) totals[s] += partials[row * kNumRowSlots + s];
  }
  double loss, metrics[kNumMetrics], grad_scale;
  finalize_loss<double>(p, totals, in.batch, plan.max_completion_length, plan.has_num_items, plan.num_items,
                        plan.loss_scale, &loss, metrics, &grad_scale);
  plan.loss.fill_(loss);
  plan.grad_scale.fill_(grad_scale);
  T* metrics_out = plan.metrics.data_ptr<T>();
  for (int s = 0; s < kNumMetrics; ++s) metrics_out[s] = T(metrics[s]);
}

LossForwardResult grpo_loss_forward_cpu(GRPO_LOSS_FORWARD_PARAMS) {
  LossForwardPlan plan = plan_loss_forward(GRPO_LOSS_FORWARD_ARGS);
  if (plan.loss.scalar_type() == at::kDouble) {
    loss_forward_cpu_impl<double>(plan);
  } else {
    loss_forward_cpu_impl<float>(plan);
  }
  return plan.result();
}

at::Tensor grpo_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& grad_raw,
                                  const at::Tensor& grad_scale, at::ScalarType out_dtype) {
  check_loss_backward(grad_loss, grad_raw, grad_scale, out_dtype);
  // The whole backward is one scale: the forward already holds d loss / d logps up to a scalar.
  const at::Tensor factor = grad_loss.reshape({}).to(grad_raw.scalar_type()) * grad_scale;
  return (grad_raw * factor).to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("grpo_loss_forward", &grpo_loss_forward_cpu);
  m.impl("grpo_loss_backward", &grpo_loss_backward_cpu);
}

}  // namespace grpo_ext
