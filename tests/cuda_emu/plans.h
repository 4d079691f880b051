// The host plans of csrc/plan/*.h as they are, run on the driver's tensors (build.py puts stable_api_emu.h in place of
// plan/stable_api.h): the arguments of a driver request in the form the plans take, and the pieces of the CUDA
// bindings (csrc/cuda/*.cu) that launch a plan on the emulated device.
#pragma once

#include <optional>

#include "driver.h"
#include "plan/logits_loss.h"

namespace cuda_emu {

// The next argument of a request as the plans' tensor type (a view of the same storage).
grpo_ext::Tensor tensor_arg(Args& a);
std::optional<grpo_ext::Tensor> optional_tensor_arg(Args& a);

// The loss options, read in GRPO_LOSS_OPTIONS order (their strings view the request's, which outlive the op call).
grpo_ext::LossOptionArgs loss_option_args(Args& a);

// cuda/grpo_loss.cu's run_loss_forward_cuda on the emulated device (ops_loss.cpp).
void run_loss_forward(grpo_ext::LossForwardPlan& plan);

}  // namespace cuda_emu
