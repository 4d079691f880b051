// Host planning of selective_log_softmax (docs/math.md section 2): checks of the logits and ids, output allocation.
#pragma once

#include <optional>
#include <tuple>

#include "checks.h"

namespace grpo_ext {

using SelectiveLogSoftmaxResult = std::tuple<Tensor, Tensor, Tensor>;

struct SelectiveLogSoftmaxPlan {
  StridedMatrix logits;  // [N, V]
  StridedMatrix ids;     // [N, 1]
  int64_t rows = 0, vocab = 0;
  LogitOptions logit;  // temperature, logit_scale, logit_softcap
  bool return_entropy = false;
  Tensor logps, entropy, row_stats;
};

inline void check_logits_and_ids(const Tensor& logits, const Tensor& ids) {
  check_float(logits, "logits");
  GRPO_CHECK(logits.dim() == 2, "logits must have shape [N, V], got ", shape(logits));
  GRPO_CHECK(logits.size(1) >= 1, "logits must have a vocabulary of at least one entry (V >= 1)");
  GRPO_CHECK(ids.scalar_type() == ScalarType::Long || ids.scalar_type() == ScalarType::Int,
             "ids must be an int64 (or int32) tensor, got ", ids.scalar_type());
  GRPO_CHECK(ids.dim() == 1 && ids.size(0) == logits.size(0), "ids must have shape [", logits.size(0), "], got ",
             shape(ids));
  check_same_device(ids, logits, "ids", "logits");
}

inline SelectiveLogSoftmaxPlan plan_selective_log_softmax(const Tensor& logits, const Tensor& ids, double temperature,
                                                          double logit_scale, double logit_softcap,
                                                          bool return_entropy) {
  check_logits_and_ids(logits, ids);
  SelectiveLogSoftmaxPlan plan;
  plan.rows = logits.size(0);
  plan.vocab = logits.size(1);
  plan.logit = check_logit_options(temperature, logit_scale, logit_softcap);
  plan.return_entropy = return_entropy;
  plan.logits = matrix_view(logits, plan.rows, plan.vocab, "logits", false);
  plan.ids = matrix_view(ids, plan.rows, 1, "ids", true);
  const ScalarType acc = accumulate_type(logits.scalar_type());
  plan.logps = new_empty(logits, {plan.rows}, acc);
  plan.entropy = new_empty(logits, {return_entropy ? plan.rows : 0}, acc);
  plan.row_stats = new_empty(logits, {plan.rows, kSoftmaxStats}, acc);
  return plan;
}

// The backward's checks; returns its logits options.
inline LogitOptions check_selective_log_softmax_backward(const Tensor& grad_logps,
                                                         const std::optional<Tensor>& grad_entropy,
                                                         const Tensor& logits, const Tensor& ids,
                                                         const Tensor& row_stats, double temperature,
                                                         double logit_scale, double logit_softcap) {
  check_logits_and_ids(logits, ids);
  const LogitOptions logit = check_logit_options(temperature, logit_scale, logit_softcap);
  const int64_t rows = logits.size(0);
  GRPO_CHECK(grad_logps.dim() == 1 && grad_logps.size(0) == rows, "grad_logps must have shape [", rows, "], got ",
             shape(grad_logps));
  check_same_device(grad_logps, logits, "grad_logps", "logits");
  if (grad_entropy.has_value()) {
    GRPO_CHECK(grad_entropy->dim() == 1 && grad_entropy->size(0) == rows, "grad_entropy must have shape [", rows,
               "], got ", shape(*grad_entropy));
    check_same_device(*grad_entropy, logits, "grad_entropy", "logits");
  }
  GRPO_CHECK(row_stats.dim() == 2 && row_stats.size(0) == rows && row_stats.size(1) == kSoftmaxStats &&
                 row_stats.is_contiguous(),
             "row_stats must be the contiguous [N, ", kSoftmaxStats, "] statistics of the forward, got ",
             shape(row_stats));
  GRPO_CHECK(row_stats.scalar_type() == accumulate_type(logits.scalar_type()),
             "row_stats must have the forward's statistics dtype");
  check_same_device(row_stats, logits, "row_stats", "logits");
  return logit;
}

}  // namespace grpo_ext
