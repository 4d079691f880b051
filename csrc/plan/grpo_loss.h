// Host planning of grpo_loss (docs/math.md sections 3-7): the forward's [B, T] plan and the backward's checks.
#pragma once

#include "loss_options.h"

// grpo_loss_forward's parameters (binding signature) and the values its plan takes.
#define GRPO_LOSS_FORWARD_PARAMS                                                \
  const Tensor &logps, const Tensor &advantages, const Tensor &completion_mask, \
      GRPO_LOSS_OPTION_PARAMS bool compute_grad
#define GRPO_LOSS_FORWARD_ARGS logps, advantages, completion_mask, GRPO_LOSS_OPTION_VALUES, compute_grad

namespace grpo_ext {

inline LossForwardPlan plan_grpo_loss(const Tensor& logps, const Tensor& advantages, const Tensor& completion_mask,
                                      const LossOptionArgs& options, bool compute_grad) {
  check_float(logps, "logps");
  GRPO_CHECK(logps.dim() == 2, "logps must have shape [B, T], got ", shape(logps));
  GRPO_CHECK(logps.size(0) >= 1, "logps must have at least one row (B >= 1), got shape ", shape(logps));
  const ScalarType acc = accumulate_type(logps.scalar_type());
  LossForwardPlan plan = plan_loss_inputs(logps.size(0), logps.size(1), &logps, logps, acc, advantages, completion_mask,
                                          options, compute_grad);
  allocate_loss_outputs(plan, logps, acc);
  return plan;
}

// The forward's kernels on the CPU (cpu/grpo_loss.cpp) and on CUDA (cuda/grpo_loss.cu), for the ops that compose
// the loss with others (plan/logits_loss.h).
void run_loss_forward_cpu(LossForwardPlan& plan);
#ifdef __CUDACC__
void run_loss_forward_cuda(LossForwardPlan& plan, cudaStream_t stream);
#endif

inline void check_loss_backward(const Tensor& grad_loss, const Tensor& grad_raw, const Tensor& grad_scale,
                                ScalarType out_dtype) {
  GRPO_CHECK(grad_loss.numel() == 1, "grad_loss must have one element, got shape ", shape(grad_loss));
  GRPO_CHECK(grad_scale.numel() == 1, "grad_scale must have one element, got shape ", shape(grad_scale));
  GRPO_CHECK(grad_raw.dim() == 2, "grad_raw must have shape [B, T] (was the forward run with compute_grad=True?)",
             ", got ", shape(grad_raw));
  GRPO_CHECK(grad_raw.is_contiguous(), "grad_raw must be contiguous");
  GRPO_CHECK(grad_raw.scalar_type() == grad_scale.scalar_type(), "grad_raw and grad_scale must share a dtype");
  check_same_device(grad_loss, grad_raw, "grad_loss", "grad_raw");
  check_same_device(grad_scale, grad_raw, "grad_scale", "grad_raw");
  GRPO_CHECK(is_float_type(out_dtype), "out_dtype must be a floating-point dtype, got ", out_dtype);
}

}  // namespace grpo_ext
