// Every op schema of grpo_ext in one TORCH_LIBRARY block (implementations register per device in cpu/ and cuda/),
// plus the small pybind11 module `_C` that reports how the extension was built.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

#include "plan/loss_options.h"

// The pass ops' arguments after `logits`: the ids they score, where they start in the [B, T] problem, the loss
// inputs, per-token gradients for the second pass of sequence-level losses, the options and the logits options
// (temperature, logit_scale, logit_softcap: 0 for no cap; docs/math.md section 2).
#define GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA                                           \
  "Tensor ids, int row_offset, Tensor advantages, Tensor completion_mask, Tensor? " \
  "token_grad, " GRPO_LOSS_OPTIONS_SCHEMA                                           \
  "float temperature, float logit_scale, float logit_softcap, bool compute_grad"

#ifndef GRPO_EXT_VERSION
#define GRPO_EXT_VERSION "0.0.0"
#endif
#ifndef GRPO_EXT_TORCH_VERSION
#define GRPO_EXT_TORCH_VERSION "unknown"
#endif
#ifndef GRPO_EXT_CUDA_ARCHS
#define GRPO_EXT_CUDA_ARCHS ""
#endif
#ifndef GRPO_EXT_CUDA_VERSION
#define GRPO_EXT_CUDA_VERSION ""
#endif

TORCH_LIBRARY(grpo_ext, m) {
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
  // cuda/grpo_loss_from_logits.cuh). The `_` op writes the gradient over the logits instead of a new tensor.
  m.def("grpo_loss_from_logits_pass(Tensor logits, " GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA
        ") -> (Tensor logps, Tensor entropy, Tensor grad_logits)");
  m.def("grpo_loss_from_logits_pass_(Tensor(a!) logits, " GRPO_LOSS_FROM_LOGITS_PASS_SCHEMA
        ") -> (Tensor logps, Tensor entropy)");
  // grad *= factor, skipped on the device when factor == 1 (the backward of the logits and hidden-state losses).
  m.def("scale_grad_(Tensor(a!) grad, Tensor factor) -> ()");
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "grpo_ext native module: the ops live in torch.ops.grpo_ext; this reports the build.";
  m.def("build_info", []() {
    pybind11::dict info;
    info["version"] = GRPO_EXT_VERSION;
    info["torch_version"] = GRPO_EXT_TORCH_VERSION;
#ifdef GRPO_EXT_WITH_CUDA
    info["cuda_compiled"] = true;
#else
    info["cuda_compiled"] = false;
#endif
    info["cuda_version"] = GRPO_EXT_CUDA_VERSION;
    info["cuda_archs"] = GRPO_EXT_CUDA_ARCHS;
#if defined(__clang__)
    info["cxx_compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["cxx_compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return info;
  });
  // The loss options' schema fragment, for the schemas of the composite ops defined in Python.
  m.attr("LOSS_OPTIONS_SCHEMA") = GRPO_LOSS_OPTIONS_SCHEMA;
}
