// grpo_loss_from_logits in one op call (docs/math.md sections 2-7): the pass over the logits rows, the [B, T] loss
// of the log-probs it wrote, the mean entropy over the kept tokens and the entropy bonus. Written once here; each
// device supplies its kernels (cpu/grpo_loss_from_logits.cpp, cuda/grpo_loss_from_logits.cu).
//
// Why one op: on a small batch a call is mostly each op's fixed host cost (Python parsing about 35 arguments, the
// dispatcher), and on a GPU that host time is the step's time. Composed in Python, the same work took two ops (37 and
// 29 arguments) and four small ones for the entropy's mean (benchmarks/bench_overhead.py, benchmarks/NOTES.md).
#pragma once

#include <optional>
#include <tuple>

#include "grpo_loss.h"
#include "grpo_loss_from_logits.h"

#define GRPO_LOGITS_LOSS_SCHEMA                                                                                   \
  "Tensor ids, Tensor advantages, Tensor completion_mask, " GRPO_LOSS_OPTIONS_SCHEMA                              \
  "float temperature, float logit_scale, float logit_softcap, float entropy_coef, Tensor? entropy_weights, bool " \
  "compute_grad"
#define GRPO_LOGITS_LOSS_PARAMS                                                                                  \
  const Tensor &logits, const Tensor &ids, const Tensor &advantages, const Tensor &completion_mask,              \
      GRPO_LOSS_OPTION_PARAMS double temperature, double logit_scale, double logit_softcap, double entropy_coef, \
      const std::optional<Tensor>&entropy_weights, bool compute_grad
#define GRPO_LOGITS_LOSS_ARGS                                                                                 \
  logits, ids, advantages, completion_mask, GRPO_LOSS_OPTION_VALUES, temperature, logit_scale, logit_softcap, \
      entropy_coef, entropy_weights, compute_grad

namespace grpo_ext {

// (loss, metrics, mean entropy over the kept tokens, d loss / d logits in the logits' shape, contiguous (empty when
// not computed, or written over the logits), [N] log-probs, [N] entropy): the loss, metrics and mean entropy in the
// accumulate dtype.
using LogitsLossResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// grad_raw * grad_scale of a loss plan run with compute_grad, as the [N] per-token d loss / d logp of the second
// pass (the sequence-level losses).
inline Tensor token_grad_of(const LossForwardPlan& plan) {
  return view_contiguous(mul(plan.grad_raw, plan.grad_scale), {plan.inputs.batch * plan.inputs.seq_len});
}

// The loss of a pass's log-probs over every token: the loss inputs the pass checked already, its [N] log-probs as
// the [B, T] logps and the options' own importance-sampling level (the pass plans per token); no tensor checked or
// viewed twice (on a small batch each costs as much as a row of the pass).
inline LossForwardPlan loss_plan_after_pass(const LogitsPassPlan& pass, const LossOptionArgs& options,
                                            bool compute_grad) {
  LossForwardPlan plan = pass.loss;
  const int64_t seq_len = plan.inputs.seq_len;
  plan.inputs.logps = StridedMatrix{pass.logps.data_ptr(), dtype_tag(pass.logps.scalar_type(), "logps"), seq_len, 1};
  plan.params.sequence_level = parse_sequence_level(options.importance_sampling_level);
  plan.params.row_share_metrics = plan.params.sequence_level && plan.params.per_row_advantages;
  plan.params.compute_grad = compute_grad;
  allocate_loss_outputs(plan, pass.logps, pass.logps.scalar_type());
  return plan;
}

// The whole loss on `device`, which provides
//   pass(LogitsPassPlan&, bool grad_in_logits): the fused pass over the plan's rows;
//   loss(LossForwardPlan&): grpo_loss' forward of the plan;
//   entropy(const LogitsPassPlan&, double entropy_coef, Tensor& loss) -> the mean of the plan's entropy over the kept
//     tokens (entropy_means in logits_loss_math.h), with loss -= entropy_bonus_scale(entropy_coef, the plan's
//     loss_scale) * (the bonus' mean) in place when entropy_coef != 0.
// `inplace`: the gradient is written over `logits` (the caller checked them with check_inplace_logits).
template <typename Device>
LogitsLossResult logits_loss(Device& device, const Tensor& logits, const Tensor& ids, const Tensor& advantages,
                             const Tensor& completion_mask, const LossOptionArgs& options, double temperature,
                             double logit_scale, double logit_softcap, double entropy_coef,
                             const std::optional<Tensor>& entropy_weights, bool compute_grad, bool inplace) {
  const std::optional<Tensor> none;
  const auto plan_pass = [&](const std::optional<Tensor>& token_grad, double coef, const std::optional<Tensor>& weights,
                             bool grad, bool in_place) {
    return plan_grpo_loss_from_logits(logits, ids, 0, advantages, completion_mask, token_grad, options, temperature,
                                      logit_scale, logit_softcap, coef, weights, grad, in_place);
  };
  // A sequence-level ratio (GSPO) or vespo's weight needs a row's every log-prob before any token's gradient: the
  // log-probs first, then the loss' d loss / d logp, then a second pass that writes the gradient.
  const bool whole_rows = compute_grad && (options.importance_sampling_level != "token" ||
                                           parse_loss_type(options.loss_type) == LossType::kVESPO);
  // (the first of two passes writes no gradient, so no bonus term; its plan still views the bonus' weights)
  LogitsPassPlan pass = whole_rows ? plan_pass(none, 0.0, entropy_weights, false, false)
                                   : plan_pass(none, entropy_coef, entropy_weights, compute_grad, inplace);
  const int64_t tokens = pass.loss.inputs.batch * pass.loss.inputs.seq_len;
  GRPO_CHECK(pass.logits.rows == tokens, "logits must have one row per token of completion_mask (B*T=", tokens,
             "), got ", pass.logits.rows, " rows");
  device.pass(pass, inplace && !whole_rows);
  LossForwardPlan loss = loss_plan_after_pass(pass, options, whole_rows);
  device.loss(loss);
  Tensor grad = pass.grad_logits;
  if (whole_rows) {
    const std::optional<Tensor> token_grad = token_grad_of(loss);  // held: the plan keeps a pointer into it
    LogitsPassPlan second = plan_pass(token_grad, entropy_coef, entropy_weights, true, inplace);
    device.pass(second, inplace);
    grad = second.grad_logits;
  }
  Tensor entropy_mean = device.entropy(pass, entropy_coef, loss.loss);
  if (compute_grad && !inplace) grad = view_contiguous(grad, logits.sizes());  // [N, V] as the logits' [B, T, V]
  return {loss.loss, loss.metrics, entropy_mean, grad, pass.logps, pass.entropy};
}

}  // namespace grpo_ext
