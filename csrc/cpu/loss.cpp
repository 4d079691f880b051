// CPU kernels of the fused GRPO loss: rows in parallel (at::parallel_for), each row in a fixed sequential order,
// row partials summed in row order, so results are bitwise reproducible whatever the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../binding_utils.h"

namespace grpo_ext {
namespace {

// One row: its loss/metric partials and, if requested, the raw gradient (before the global scale).
template <typename T>
void loss_row(const LossParams& p, const LossInputs& in, int64_t row, double* partials, T* grad_row) {
  using std::exp;
  const int64_t n_cols = in.seq_len;
  const bool need_count = per_row_normalized(p.loss_type) || p.sequence_level;
  double count = 0.0, log_ratio_sum = 0.0;
  if (need_count) {
    for (int64_t t = 0; t < n_cols; ++t) {
      const T m = in.mask_at<T>(row, t);
      if (m == T(0)) continue;
      count += m;
      if (p.sequence_level && p.has_old) {
        log_ratio_sum += double(m) * double(in.logps.load<T>(row, t) - in.old_logps.load<T>(row, t));
      }
    }
  }
  const double count_clamped = count > 1.0 ? count : 1.0;
  const T seq_ratio = p.sequence_level ? T(exp(log_ratio_sum / count_clamped)) : T(1);
  const T row_factor = per_row_normalized(p.loss_type) ? T(1.0 / count_clamped) : T(1);
  const bool want_kl = p.beta != 0.0;

  double acc[kNumRowSlots] = {0, 0, 0, 0, 0, 0, 0};
  double drho_sum = 0.0;  // sequence level: sum_t w * dP/drho
  for (int64_t t = 0; t < n_cols; ++t) {
    const T m = in.mask_at<T>(row, t);
    if (m == T(0)) {
      if (grad_row) grad_row[t] = T(0);
      continue;
    }
    const T l = in.logps.load<T>(row, t);
    const T rho = p.sequence_level ? seq_ratio : (p.has_old ? exp(l - in.old_logps.load<T>(row, t)) : T(1));
    const T adv = in.advantages.load<T>(row, t);
    const T l_ref = want_kl ? in.ref_logps.load<T>(row, t) : T(0);
    const T isw = in.is_weights.present() ? in.is_weights.load<T>(row, t) : T(1);
    const TokenTerms<T> tt = token_terms<T>(p, l, l_ref, adv, isw, rho);
    const T w = m * row_factor;
    acc[kSlotLoss] += double(w * tt.loss);
    acc[kSlotMask] += double(m);
    acc[kSlotKL] += double(m * tt.kl);
    if (!p.row_share_metrics) {
      acc[kSlotLow] += tt.low ? double(m) : 0.0;
      acc[kSlotHigh] += tt.high ? double(m) : 0.0;
      acc[kSlotRegion] += (tt.low || tt.high) ? double(m) : 0.0;
      acc[kSlotCispo] += tt.cispo_clipped ? double(m) : 0.0;
    }
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
      const T m = in.mask_at<T>(row, t);
      if (m != T(0)) grad_row[t] += through_ratio * m;
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
    for (int64_t row = begin; row < end; ++row) {
      loss_row<T>(p, in, row, partials.data() + row * kNumRowSlots, grad ? grad + row * in.seq_len : nullptr);
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
