// Every op schema of grpo_ext in one STABLE_TORCH_LIBRARY block (implementations register per device in cpu/ and
// cuda/), plus the loss options' schema fragment as a C function. How the library was built is not asked of it:
// CMake writes it into python/grpo_ext/_build_config.py, readable before the library is loaded.
#include "plan/logits_loss.h"

// The pass ops' arguments after `logits`: the ids they score, where they start in the [B, T] problem, the loss
// inputs, per-token gradients for the second pass of sequence-level losses, the options and the logits options
// (temperature, logit_scale, logit_softcap: 0 for no cap; docs/math.md section 2) and the entropy bonus'
// coefficient (0: none; section 5) with the weights of the tokens in its mean (None: every kept token).
#define GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA                                                                    \
  "Tensor ids, int row_offset, Tensor advantages, Tensor completion_mask, Tensor? "                          \
  "token_grad, " GRPO_LOSS_OPTIONS_SCHEMA                                                                    \
  "float temperature, float logit_scale, float logit_softcap, float entropy_coef, Tensor? entropy_weights, " \
  "bool compute_grad"

STABLE_TORCH_LIBRARY(grpo_ext, m) {
  m.def(
      "group_advantages(Tensor rewards, Tensor? reward_weights, int group_size, str scale_rewards, str baseline, "
      "str multi_objective_aggregation, float eps, int std_ddof, str singleton_groups=\"zero\", Tensor? "
      "group_ids=None, "
      "int num_groups=0) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "process_advantages(Tensor step_rewards, Tensor step_end, int group_size, int seq_len, float eps, "
      "int std_ddof) -> Tensor");
  // The loss options (GRPO_LOSS_OPTIONS_SCHEMA) come from their one definition in plan/loss_options.h.
  m.def("grpo_loss_forward(Tensor logps, Tensor advantages, Tensor completion_mask, " GRPO_LOSS_OPTIONS_SCHEMA
        "bool compute_grad) -> (Tensor loss, Tensor metrics, Tensor grad_raw, Tensor grad_scale)");
  m.def("grpo_loss_backward(Tensor grad_loss, Tensor grad_raw, Tensor grad_scale, ScalarType out_dtype) -> Tensor");
  m.def(
      "selective_log_softmax_forward(Tensor logits, Tensor ids, float temperature, float logit_scale, "
      "float logit_softcap, bool return_entropy) -> "
      "(Tensor logps, Tensor entropy, Tensor row_stats)");
  m.def(
      "selective_log_softmax_backward(Tensor grad_logps, Tensor? grad_entropy, Tensor logits, Tensor ids, "
      "Tensor row_stats, float temperature, float logit_scale, float logit_softcap) -> Tensor");
  // grpo_loss_from_logits' fused pass over rows of logits (token-level gradient in the same pass; see
  // cuda/grpo_loss_from_logits*.cuh). The `_` op writes the gradient over the logits instead of a new tensor.
  m.def("grpo_loss_from_logits_pass(Tensor logits, " GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA
        ") -> (Tensor logps, Tensor entropy, Tensor grad_logits)");
  m.def("grpo_loss_from_logits_pass_(Tensor(a!) logits, " GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA
        ") -> (Tensor logps, Tensor entropy)");
  // grpo_loss_from_logits whole in one call (plan/logits_loss.h): the pass(es), the loss of its log-probs, the mean
  // entropy and the entropy bonus. The `_` op writes the gradient over the logits (eager mode only).
  m.def("grpo_loss_from_logits(Tensor logits, " GRPO_LOGITS_LOSS_SCHEMA
        ") -> (Tensor loss, Tensor metrics, Tensor entropy_mean, Tensor grad_logits, Tensor logps, Tensor entropy)");
  m.def("grpo_loss_from_logits_(Tensor(a!) logits, " GRPO_LOGITS_LOSS_SCHEMA
        ") -> (Tensor loss, Tensor metrics, Tensor entropy_mean, Tensor logps, Tensor entropy)");
  // grad *= factor, skipped on the device when factor == 1 (the backward of the logits and hidden-state losses).
  m.def("scale_grad_(Tensor(a!) grad, Tensor factor) -> ()");
}

// The loss options' schema fragment, for the schemas of the composite ops defined in Python (read with ctypes:
// the library carries no Python C-API, so one binary serves every Python version).
extern "C" __attribute__((visibility("default"))) const char* grpo_ext_loss_options_schema() {
  return GRPO_LOSS_OPTIONS_SCHEMA;
}
