// Every op schema of grpo_ext in one TORCH_LIBRARY block (implementations register per device in cpu/ and cuda/),
// plus the small pybind11 module `_C` that reports how the extension was built.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

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

// The arguments of grpo_logits_pass after `logits` (the loss op's, plus the chunk's row offset, per-token
// gradients for the second pass of sequence-level losses, and the temperature).
#define GRPO_LOGITS_PASS_SCHEMA_ARGS                                                                              \
  "Tensor ids, int row_offset, Tensor advantages, Tensor completion_mask, Tensor? old_logps, Tensor? ref_logps, " \
  "Tensor? is_weights, Tensor? sample_mask, float? num_items_in_batch, Tensor? num_items_tensor, "               \
  "Tensor? token_grad, str loss_type, float epsilon_low, float epsilon_high, float? delta, float beta, "          \
  "str kl_estimator, float? kl_clamp, bool use_bias_correction_kl, int max_completion_length, "                  \
  "float sapo_temperature_pos, float sapo_temperature_neg, float loss_scale, float temperature, bool compute_grad"

TORCH_LIBRARY(grpo_ext, m) {
  m.def(
      "group_advantages(Tensor rewards, Tensor? reward_weights, int group_size, str scale_rewards, str baseline, "
      "str multi_objective_aggregation, float eps, int std_ddof) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "process_advantages(Tensor step_rewards, Tensor step_end, int group_size, int seq_len, float eps, "
      "int std_ddof) -> Tensor");
  m.def(
      "grpo_loss_forward(Tensor logps, Tensor advantages, Tensor completion_mask, Tensor? old_logps, "
      "Tensor? ref_logps, Tensor? is_weights, Tensor? sample_mask, float? num_items_in_batch, "
      "Tensor? num_items_tensor, str loss_type, float epsilon_low, float epsilon_high, float? delta, float beta, "
      "str kl_estimator, float? kl_clamp, bool use_bias_correction_kl, str importance_sampling_level, "
      "int max_completion_length, float sapo_temperature_pos, float sapo_temperature_neg, float loss_scale, "
      "bool compute_grad) -> (Tensor loss, Tensor metrics, Tensor grad_raw, Tensor grad_scale)");
  m.def("grpo_loss_backward(Tensor grad_loss, Tensor grad_raw, Tensor grad_scale, ScalarType out_dtype) -> Tensor");
  m.def(
      "selective_log_softmax_forward(Tensor logits, Tensor ids, float temperature, bool return_entropy) -> "
      "(Tensor logps, Tensor entropy, Tensor row_stats)");
  m.def(
      "selective_log_softmax_backward(Tensor grad_logps, Tensor? grad_entropy, Tensor logits, Tensor ids, "
      "Tensor row_stats, float temperature) -> Tensor");
  // The loss from logits (token-level gradient in the same pass; see cuda/logits_loss_kernels.cuh). The `_` op
  // writes the gradient over the logits instead of into a new tensor.
  m.def("grpo_logits_pass(Tensor logits, " GRPO_LOGITS_PASS_SCHEMA_ARGS
        ") -> (Tensor logps, Tensor entropy, Tensor grad_logits)");
  m.def("grpo_logits_pass_(Tensor(a!) logits, " GRPO_LOGITS_PASS_SCHEMA_ARGS ") -> (Tensor logps, Tensor entropy)");
  // grad *= factor, skipped on the device when factor == 1 (the backward of the logits losses).
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
}
