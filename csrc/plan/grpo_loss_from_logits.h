// Host planning of grpo_loss_from_logits' fused pass (docs/math.md sections 2-7): the logits rows, the [B, T] loss
// inputs they score, and the outputs (log-probs, entropy, and the gradient in a new buffer or over the logits).
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "loss_options.h"

// The pass op's parameters (binding signature) and the values its plan takes (the in-place op adds `inplace`).
#define GRPO_LOSS_FROM_LOGITS_PASS_PARAMS                                                                        \
  const Tensor &logits, const Tensor &ids, int64_t row_offset, const Tensor &advantages,                         \
      const Tensor &completion_mask, const std::optional<Tensor>&token_grad,                                     \
      GRPO_LOSS_OPTION_PARAMS double temperature, double logit_scale, double logit_softcap, double entropy_coef, \
      const std::optional<Tensor>&entropy_weights, bool compute_grad
#define GRPO_LOSS_FROM_LOGITS_PASS_ARGS                                                                                \
  logits, ids, row_offset, advantages, completion_mask, token_grad, GRPO_LOSS_OPTION_VALUES, temperature, logit_scale, \
      logit_softcap, entropy_coef, entropy_weights, compute_grad

namespace grpo_ext {

using LogitsPassResult = std::tuple<Tensor, Tensor, Tensor>;

struct LogitsPassPlan {
  LossForwardPlan loss;  // the [B, T] loss inputs and options (its logps view is unused)
  LogitsRows logits;
  StridedMatrix ids;         // [R, 1]
  StridedMatrix token_grad;  // [R, 1] d loss / d logp per row, or absent (then computed from the loss inputs)
  int64_t row_offset = 0;    // row r of the logits is token row_offset + r of the flattened [B, T] problem
  LogitOptions logit;        // temperature, logit_scale, logit_softcap
  // The entropy bonus' coefficient (docs/math.md section 5, "Entropy bonus"): the gradient of -entropy_coef *
  // loss_scale * H, H the mean entropy over the kept tokens of the whole [B, T] problem, is added to each row's (0: no
  // bonus).
  double entropy_coef = 0.0;
  StridedMatrix entropy_weights;  // [B, T] weights of the tokens in the bonus' mean (default: every kept token)
  bool compute_grad = true;
  Tensor logps, entropy, grad_logits;
  void* grad_data = nullptr;  // grad_logits' storage, or the logits' own for the in-place op
  DType grad_dtype = DType::kFloat32;
  LogitsPassResult result() const { return {logps, entropy, grad_logits}; }
};

// Rows of [R, V] or [B', T', V] logits whose last dimension is contiguous (rows may be strided).
inline LogitsRows logits_rows(const Tensor& logits) {
  GRPO_CHECK(logits.dim() == 2 || logits.dim() == 3, "logits must have shape [N, V] or [B, T, V], got ", shape(logits));
  GRPO_CHECK(logits.size(-1) >= 1, "logits must have a vocabulary of at least one entry (V >= 1)");
  GRPO_CHECK(logits.stride(-1) == 1 || logits.size(-1) == 1,
             "logits must be contiguous in the vocabulary dimension (stride(-1) == 1), got strides ", strides(logits),
             "; pass logits.contiguous()");
  return logits_rows_of(logits.data_ptr(), dtype_tag(logits.scalar_type(), "logits"), logits.dim(),
                        logits.sizes().data(), logits.strides().data());
}

inline LogitsPassPlan plan_grpo_loss_from_logits(const Tensor& logits, const Tensor& ids, int64_t row_offset,
                                                 const Tensor& advantages, const Tensor& completion_mask,
                                                 const std::optional<Tensor>& token_grad, const LossOptionArgs& options,
                                                 double temperature, double logit_scale, double logit_softcap,
                                                 double entropy_coef, const std::optional<Tensor>& entropy_weights,
                                                 bool compute_grad, bool inplace) {
  check_float(logits, "logits");
  const LogitOptions logit = check_logit_options(temperature, logit_scale, logit_softcap);
  GRPO_CHECK(std::isfinite(entropy_coef), "entropy_coef must be a finite number, got ", entropy_coef);
  GRPO_CHECK(completion_mask.dim() == 2, "completion_mask must have shape [B, T], got ", shape(completion_mask));
  const int64_t batch = completion_mask.size(0), seq_len = completion_mask.size(1);
  GRPO_CHECK(batch >= 1, "completion_mask must have at least one row (B >= 1), got shape ", shape(completion_mask));
  LogitsPassPlan plan;
  plan.logits = logits_rows(logits);
  const int64_t rows = plan.logits.rows;
  GRPO_CHECK(row_offset >= 0 && row_offset + rows <= batch * seq_len, "row_offset=", row_offset, " and ", rows,
             " logits rows exceed the B*T=", batch * seq_len, " tokens of completion_mask");
  GRPO_CHECK(ids.scalar_type() == ScalarType::Long || ids.scalar_type() == ScalarType::Int,
             "ids must be an int64 (or int32) tensor, got ", ids.scalar_type());
  // [N] ids, or contiguous [B', T'] ones with one per row (the whole op's [B, T] ids, unreshaped)
  const bool flat_2d = ids.dim() == 2 && ids.numel() == rows && ids.is_contiguous();
  GRPO_CHECK((ids.dim() == 1 && ids.size(0) == rows) || flat_2d, "ids must have shape [", rows,
             "] (one per logits row), got ", shape(ids));
  check_same_device(ids, logits, "ids", "logits");
  plan.ids = flat_2d ? StridedMatrix{ids.data_ptr(), dtype_tag(ids.scalar_type(), "ids"), 1, 0}
                     : matrix_view(ids, rows, 1, "ids", true);
  const ScalarType acc = accumulate_type(logits.scalar_type());
  // The pass itself is per token: a sequence-level loss hands in each token's d loss / d logp as token_grad.
  LossOptionArgs token_options = options;
  token_options.importance_sampling_level = "token";
  plan.loss = plan_loss_inputs(batch, seq_len, nullptr, logits, acc, advantages, completion_mask, token_options,
                               /*compute_grad=*/false, "logits");
  // vespo's phi needs every log-prob of its row, which a pass over some logits rows does not see.
  GRPO_CHECK(!compute_grad || token_grad.has_value() || plan.loss.params.loss_type != LossType::kVESPO,
             "loss_type='vespo' needs token_grad (its gradient depends on whole rows) when compute_grad is true");
  if (token_grad.has_value()) {
    const Tensor& g = *token_grad;
    check_float(g, "token_grad");
    check_same_device(g, logits, "token_grad", "logits");
    GRPO_CHECK(g.dim() == 1 && g.size(0) == rows, "token_grad must have shape [", rows, "], got ", shape(g));
    plan.token_grad = matrix_view(g, rows, 1, "token_grad", true);
  }
  plan.row_offset = row_offset;
  plan.logit = logit;
  plan.entropy_coef = entropy_coef;
  if (entropy_weights.has_value()) {
    const Tensor& w = *entropy_weights;
    GRPO_CHECK(w.scalar_type() == ScalarType::Bool || is_float_type(w.scalar_type()),
               "entropy_weights must be bool or floating-point, got ", w.scalar_type());
    check_same_device(w, logits, "entropy_weights", "logits");
    plan.entropy_weights = matrix_view(w, batch, seq_len, "entropy_weights", false);
  }
  plan.compute_grad = compute_grad;
  plan.logps = new_empty(logits, {rows}, acc);
  plan.entropy = new_empty(logits, {rows}, acc);
  plan.grad_dtype = plan.logits.dtype;
  if (inplace) {
    plan.grad_data = logits.data_ptr();
    plan.grad_logits = new_empty(logits, {0}, logits.scalar_type());
  } else if (compute_grad) {
    plan.grad_logits = new_empty(logits, {rows, plan.logits.vocab}, logits.scalar_type());
    plan.grad_data = plan.grad_logits.data_ptr();
  } else {
    plan.grad_logits = new_empty(logits, {0}, logits.scalar_type());
  }
  return plan;
}

// The in-place op writes each row's gradient over that row of the logits: the rows must not overlap.
inline void check_inplace_logits(const Tensor& logits) {
  GRPO_CHECK(logits.scalar_type() == ScalarType::Float || logits.scalar_type() == ScalarType::BFloat16 ||
                 logits.scalar_type() == ScalarType::Half || logits.scalar_type() == ScalarType::Double,
             "inplace logits must be float32, bfloat16, float16 or float64, got ", logits.scalar_type());
  GRPO_CHECK(!is_inference(logits), "inplace_grad cannot write into an inference tensor");
  // Rows are disjoint when, taking the row dimensions by increasing stride, each stride clears the span of a row and
  // of the dimensions before it: a sufficient rule, met by every layout torch makes (a stride of at least V per
  // dimension is not: sizes [2, 2, V] at strides [V, V, 1] give rows (0, 1) and (1, 0) the same memory).
  if (logits.dim() != 2 && logits.dim() != 3) return;  // plan_grpo_loss_from_logits refuses the shape
  std::pair<int64_t, int64_t> row_dims[2];  // (stride, size) of the row dimensions that hold more than one row
  int n_row_dims = 0;
  for (int64_t d = 0; d + 1 < logits.dim(); ++d) {
    if (logits.size(d) > 1) row_dims[n_row_dims++] = {logits.stride(d), logits.size(d)};
  }
  std::sort(row_dims, row_dims + n_row_dims);
  int64_t span = (std::max<int64_t>(logits.size(-1), 1) - 1) * logits.stride(-1) + 1;
  bool rows_disjoint = true;
  for (int i = 0; i < n_row_dims && rows_disjoint; ++i) {
    rows_disjoint = row_dims[i].first >= span;
    span += row_dims[i].first * (row_dims[i].second - 1);
  }
  GRPO_CHECK(rows_disjoint, "inplace_grad needs logits whose rows do not overlap in memory, got shape ", shape(logits),
             " with strides ", strides(logits));
}

}  // namespace grpo_ext
