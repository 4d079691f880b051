// CPU kernels of the fused GRPO loss: rows in parallel (torch::stable::parallel_for), each row in a fixed sequential
// order, row partials summed in row order, so results are bitwise reproducible whatever the thread count.

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../plan/grpo_loss.h"
#include "row_utils.h"

namespace grpo_ext {
namespace {

using cpu::lane_sum;
using cpu::row_values;

// Per-thread scratch: rows of inputs that need converting, and the per-token contributions that are summed.
template <typename T>
struct RowScratch {
  std::vector<T> mask, logps, old_logps, ref_logps, advantages, is_weights, policy_weights;
  std::vector<T> contributions;  // kNumRowSlots + 1 rows of n: loss, mask, kl, low, high, region, cispo, phi, dP/drho
  std::vector<T> grad;           // the gradient's destination when none is wanted
  int64_t n;
  explicit RowScratch(int64_t n_cols)
      : mask(n_cols),
        logps(n_cols),
        old_logps(n_cols),
        ref_logps(n_cols),
        advantages(n_cols),
        is_weights(n_cols),
        policy_weights(n_cols),
        contributions((kNumRowSlots + 1) * n_cols),
        grad(n_cols),
        n(n_cols) {}
  T* slot(int s) { return contributions.data() + s * n; }
};

// dst = src where m != 0, else 0: garbage under the mask (NaN, -inf) never reaches the arithmetic. The load comes
// first and unconditionally, which is what lets the compiler vectorize the select.
template <typename T>
void sanitize_row(int64_t n, const T* __restrict__ m, const T* __restrict__ src, T* __restrict__ dst) {
  for (int64_t t = 0; t < n; ++t) {
    const T value = src[t];
    dst[t] = m[t] != T(0) ? value : T(0);
  }
}

// The token loop, compiled twice: for baseline x86-64 (SSE2, 4 floats a vector) and for AVX2 (8), chosen at run
// time. No FMA in either, so both round alike and a result does not depend on the machine's vector width beyond
// the order of additions inside a vector (which is fixed per instruction set).
#ifdef GRPO_EXT_X86_AVX2  // row_utils.h: GCC on x86-64
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2")
#include "grpo_loss_tokens.inc"
#pragma GCC pop_options
}  // namespace isa_avx2
#endif
namespace isa_baseline {
#include "grpo_loss_tokens.inc"
}  // namespace isa_baseline

// One row: its loss/metric partials and, if requested, the raw gradient (before the global scale).
template <typename T>
void loss_row(const LossParams& p, const TokenConsts<T>& consts, const LossInputs& in, int64_t row,
              RowScratch<T>& scratch, double* partials, T* grad_row) {
  const int64_t n_cols = in.seq_len;
  const bool want_kl = p.beta != 0.0;
  // m_eff = mask * sample_mask: a dropped row reads nothing else.
  const T row_keep = in.sample_mask.present() ? in.sample_mask.load<T>(row, 0) : T(1);
  if (row_keep == T(0)) {
    if (grad_row) std::fill(grad_row, grad_row + n_cols, T(0));
    for (int s = 0; s < kNumRowSlots; ++s) partials[s] = 0.0;
    // vespo's phi over rows: a row without tokens has log w = 0, and phi = exp(lambda - lambda) = 1
    if (p.loss_type == LossType::kVESPO && p.per_row_advantages) partials[kSlotPhi] = 1.0;
    if (p.row_share_metrics) {  // every row counts in the row shares; a row without tokens has ratio 1
      set_row_clip_shares<T>(consts, T(1), in.advantages.load<T>(row, 0), partials);
    }
    return;
  }
  // m_eff, then every input as a contiguous row with zeros under the mask.
  const T* mask_in = row_values(in.mask, row, n_cols, scratch.mask.data());
  T* mask = scratch.mask.data();
  for (int64_t t = 0; t < n_cols; ++t) mask[t] = mask_in[t] * row_keep;
  auto clean = [&](const StridedMatrix& m, std::vector<T>& buffer) -> const T* {
    const T* values = row_values(m, row, n_cols, buffer.data());
    sanitize_row(n_cols, mask, values, buffer.data());
    return buffer.data();
  };
  const T* logps = clean(in.logps, scratch.logps);
  // Absent inputs: on-policy old = logps (rho = 1 exactly); no KL reads logps in place of ref; weights of 1.
  const T* old_logps = p.has_old ? clean(in.old_logps, scratch.old_logps) : logps;
  const T* ref_logps = want_kl ? clean(in.ref_logps, scratch.ref_logps) : logps;
  const T* advantages = clean(in.advantages, scratch.advantages);
  const T* is_weights;
  if (in.is_weights.present()) {
    is_weights = clean(in.is_weights, scratch.is_weights);
  } else {
    std::fill(scratch.is_weights.begin(), scratch.is_weights.end(), T(1));
    is_weights = scratch.is_weights.data();
  }

  double phi_partial = 0.0;
  if (p.loss_type == LossType::kVESPO) {    // phi of each token, in place of its is_weight (docs/math.md section 3)
    T* terms = scratch.slot(kNumRowSlots);  // the token loop overwrites this scratch row later
    const bool has_is_weights = in.is_weights.present();
    for (int64_t t = 0; t < n_cols; ++t) {
      terms[t] = mask[t] * vespo_token_log_weight(log_ratio_of(logps[t], old_logps[t]), is_weights[t], has_is_weights);
    }
    const T log_w = vespo_row_log_weight(T(lane_sum(terms, n_cols)));
    // Masked tokens get phi 0, not the row's: a non-finite kept input makes log_w NaN, and the token loop's
    // 0 * NaN would put it in their gradient, which must stay 0 (docs/math.md, non-finite inputs).
    T* phi = scratch.is_weights.data();
    for (int64_t t = 0; t < n_cols; ++t) phi[t] = mask[t] != T(0) ? vespo_phi(consts, log_w, advantages[t]) : T(0);
    is_weights = phi;
    if (p.per_row_advantages) {
      phi_partial = double(vespo_phi(consts, log_w, in.advantages.load<T>(row, 0)));
    } else {
      for (int64_t t = 0; t < n_cols; ++t) terms[t] = mask[t] * phi[t];
      phi_partial = lane_sum(terms, n_cols);
    }
  }

  if (in.policy_weights.present()) {  // on the policy term's weight (is_weights or phi), after phi's metric
    const T* policy_weights = clean(in.policy_weights, scratch.policy_weights);
    T* weights = scratch.is_weights.data();  // is_weights points here in every case above
    for (int64_t t = 0; t < n_cols; ++t) weights[t] = is_weights[t] * policy_weights[t];
    is_weights = weights;
  }

  const bool need_count = per_row_normalized(p.loss_type) || p.sequence_level;
  const double count = need_count ? lane_sum(mask, n_cols) : 0.0;
  double log_ratio_sum = 0.0;
  if (p.sequence_level) {  // sum_t m * (l - l_old), through a scratch row so that both loops vectorize
    T* log_ratio = scratch.slot(kNumRowSlots);
    for (int64_t t = 0; t < n_cols; ++t) log_ratio[t] = mask[t] * log_ratio_of(logps[t], old_logps[t]);
    log_ratio_sum = lane_sum(log_ratio, n_cols);
  }
  const double count_clamped = count > 1.0 ? count : 1.0;
  const T seq_ratio = p.sequence_level ? math_exp(T(log_ratio_sum / count_clamped)) : T(1);
  const T row_factor = per_row_normalized(p.loss_type) ? T(1.0 / count_clamped) : T(1);
  const bool lone_row =
      p.sequence_level &&
      ratio_is_the_lone_tokens(true, double(std::count_if(mask, mask + n_cols, [](T m) { return m != T(0); })), count);

  dispatch_token_terms<T>(policy_family(p.loss_type), kl_kind(p), p.bias_correction, [&](auto terms) {
    T* grad_out = grad_row ? grad_row : scratch.grad.data();  // one store path keeps the loop branch-free
    auto run = [&](auto sequence_level) {
      constexpr bool kSequence = decltype(sequence_level)::value;
      auto args =
          std::make_tuple(terms, consts, n_cols, mask, logps, old_logps, ref_logps, advantages, is_weights, seq_ratio,
                          lone_row, row_factor, scratch.slot(kSlotLoss), scratch.slot(kSlotMask), scratch.slot(kSlotKL),
                          scratch.slot(kSlotLow), scratch.slot(kSlotHigh), scratch.slot(kSlotRegion),
                          scratch.slot(kSlotCispo), scratch.slot(kNumRowSlots), grad_out);
#ifdef GRPO_EXT_X86_AVX2
      if (cpu::cpu_has_avx2()) {
        std::apply([](auto&&... a) { isa_avx2::loss_row_tokens<T, kSequence>(a...); }, args);
        return;
      }
#endif
      std::apply([](auto&&... a) { isa_baseline::loss_row_tokens<T, kSequence>(a...); }, args);
    };
    if (p.sequence_level) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  for (int s = 0; s < kSlotNonEmpty; ++s) {  // the token loop writes every slot but phi's and kSlotNonEmpty
    partials[s] = s == kSlotPhi ? phi_partial : lane_sum(scratch.slot(s), n_cols);
  }
  partials[kSlotNonEmpty] = partials[kSlotMask] > 0.0 ? 1.0 : 0.0;
  if (p.row_share_metrics) set_row_clip_shares<T>(consts, seq_ratio, in.advantages.load<T>(row, 0), partials);
  if (grad_row && p.sequence_level) {
    // d s_i / d l[i,t] = s_i * m[i,t] / max(n_i, 1), times sum_t w * dP/drho
    const T row_drho = T(lane_sum(scratch.slot(kNumRowSlots), n_cols) / count_clamped);
    // With bias correction the KL's own path, rho * w * beta * dKL/dl, joins the row's factor of rho before the
    // product: an overflowed ratio gives the limit by the sum's sign, not inf - inf (docs/math.md section 8).
    // kl_slope is 0 for kNone; a lone row's summed factor holds its own KL path already (ratio_is_the_lone_tokens)
    const KLKind own_kl = p.bias_correction && !lone_row ? kl_kind(p) : KLKind::kNone;
    for (int64_t t = 0; t < n_cols; ++t) {
      // A masked token keeps its zero even when the row's ratio is NaN (a non-finite kept input).
      if (mask[t] == T(0)) {
        grad_row[t] = T(0);
        continue;
      }
      const T own = mask[t] * row_factor * kl_slope(consts, own_kl, logps[t], ref_logps[t]);
      grad_row[t] += through_ratio_exp(mask[t] * row_drho + own, seq_ratio);
    }
  }
}

template <typename T>
void loss_forward_cpu_impl(LossForwardPlan& plan) {
  const LossInputs& in = plan.inputs;
  const LossParams& p = plan.params;
  std::vector<double> partials(static_cast<size_t>(in.batch) * kNumRowSlots);
  T* grad = p.compute_grad ? plan.grad_raw.mutable_data_ptr<T>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(in.seq_len, 1));
  const TokenConsts<T> consts(p);
  torch::stable::parallel_for(0, in.batch, grain, [&](int64_t begin, int64_t end) {
    RowScratch<T> scratch(in.seq_len);
    for (int64_t row = begin; row < end; ++row) {
      loss_row<T>(p, consts, in, row, scratch, partials.data() + row * kNumRowSlots,
                  grad ? grad + row * in.seq_len : nullptr);
    }
  });
  double totals[kNumRowSlots] = {};
  for (int64_t row = 0; row < in.batch; ++row) {
    for (int s = 0; s < kNumRowSlots; ++s) totals[s] += partials[row * kNumRowSlots + s];
  }
  double loss, metrics[kNumMetrics], grad_scale;
  finalize_loss<double>(p, totals, in.batch, plan.max_completion_length, plan.has_num_items, plan.num_items,
                        plan.loss_scale, &loss, metrics, &grad_scale);
  *plan.loss.mutable_data_ptr<T>() = T(loss);
  *plan.grad_scale.mutable_data_ptr<T>() = T(grad_scale);
  T* metrics_out = plan.metrics.mutable_data_ptr<T>();
  for (int s = 0; s < kNumMetrics; ++s) metrics_out[s] = T(metrics[s]);
}

}  // namespace

void run_loss_forward_cpu(LossForwardPlan& plan) {
  if (plan.loss.scalar_type() == ScalarType::Double) {
    loss_forward_cpu_impl<double>(plan);
  } else {
    loss_forward_cpu_impl<float>(plan);
  }
}

namespace {

LossForwardResult grpo_loss_forward_cpu(GRPO_LOSS_FORWARD_PARAMS) {
  LossForwardPlan plan = plan_grpo_loss(GRPO_LOSS_FORWARD_ARGS);
  run_loss_forward_cpu(plan);
  return plan.result();
}

Tensor grpo_loss_backward_cpu(const Tensor& grad_loss, const Tensor& grad_raw, const Tensor& grad_scale,
                              ScalarType out_dtype) {
  check_loss_backward(grad_loss, grad_raw, grad_scale, out_dtype);
  // The whole backward is one scale: the forward already holds d loss / d logps up to a scalar.
  Tensor out = new_empty(grad_raw, grad_raw.sizes(), out_dtype);
  const StridedMatrix grad_loss_view{grad_loss.data_ptr(), dtype_tag(grad_loss.scalar_type(), "grad_loss")};
  const auto scale = [&](auto raw_tag, auto out_tag) {
    using T = decltype(raw_tag);
    using Out = decltype(out_tag);
    // factor in the gradient's dtype, then each product rounded once to it, then cast (as grad_raw * factor).to())
    const T factor = grad_loss_view.load<T>(0, 0) * *grad_scale.const_data_ptr<T>();
    const T* raw = grad_raw.const_data_ptr<T>();
    Out* dst = static_cast<Out*>(out.mutable_data_ptr());
    torch::stable::parallel_for(0, grad_raw.numel(), 32768, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = Out(raw[i] * factor);
    });
  };
  const auto with_out = [&](auto raw_tag) {
    switch (out_dtype) {
      case ScalarType::Double: scale(raw_tag, double{}); break;
      case ScalarType::Float: scale(raw_tag, float{}); break;
      case ScalarType::BFloat16: scale(raw_tag, BFloat16{}); break;
      default: scale(raw_tag, Half{}); break;
    }
  };
  if (grad_raw.scalar_type() == ScalarType::Double) {
    with_out(double{});
  } else {
    with_out(float{});
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("grpo_loss_forward", TORCH_BOX(&grpo_loss_forward_cpu));
  m.impl("grpo_loss_backward", TORCH_BOX(&grpo_loss_backward_cpu));
}

}  // namespace grpo_ext
