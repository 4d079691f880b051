// CUDA binding of the fused GRPO loss from logits: validate, allocate, pick the dtypes, launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "../plan/grpo_loss_from_logits.h"
#include "grpo_loss_from_logits.cuh"

namespace grpo_ext {
namespace {

// What the current device offers the single-read pass (attribute queries: no sync). GRPO_EXT_LOGITS_SINGLE_READ=0
// keeps every row on the two-read pass (to compare the two on a GPU).
RowResidency row_residency() {
  const char* single_read = std::getenv("GRPO_EXT_LOGITS_SINGLE_READ");
  if (single_read != nullptr && std::strcmp(single_read, "0") == 0) return {};
  const int device = c10::cuda::current_device();
  int shared = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return {static_cast<size_t>(shared), major >= 9 ? 8u : 1u};  // clusters of up to 8 blocks are portable on sm_90
}

template <typename T, typename In>
void run_pass(LogitsPassPlan& plan, bool grad_in_logits, cudaStream_t stream) {
  LogitsPassArgs args{plan.loss.params,
                      plan.loss.inputs,
                      plan.logits,
                      plan.ids,
                      plan.token_grad,
                      plan.row_offset,
                      plan.compute_grad && plan.grad_data != nullptr,
                      grad_in_logits};
  at::Tensor row_weight;
  if (args.compute_grad && !plan.token_grad.present()) {
    row_weight = at::empty({plan.loss.inputs.batch}, plan.logps.options());
    const LossForwardPlan& lp = plan.loss;
    const T* num_items_device = lp.num_items_device.defined() ? lp.num_items_device.data_ptr<T>() : nullptr;
    launch_grpo_loss_from_logits_row_weights<T>(lp.params, lp.inputs, lp.max_completion_length, lp.has_num_items,
                                                T(lp.num_items), num_items_device, T(lp.loss_scale),
                                                row_weight.data_ptr<T>(), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_grpo_loss_from_logits<T, In>(
      args, plan.logit.transform<T>(), row_weight.defined() ? row_weight.data_ptr<T>() : nullptr,
      static_cast<In*>(plan.grad_data), plan.logps.data_ptr<T>(), plan.entropy.data_ptr<T>(), row_residency(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_logits_pass(LogitsPassPlan& plan, bool grad_in_logits) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (plan.logits.dtype) {
    case DType::kFloat64: run_pass<double, double>(plan, grad_in_logits, stream); break;
    case DType::kFloat32: run_pass<float, float>(plan, grad_in_logits, stream); break;
    case DType::kBFloat16: run_pass<float, __nv_bfloat16>(plan, grad_in_logits, stream); break;
    case DType::kFloat16: run_pass<float, __half>(plan, grad_in_logits, stream); break;
    default: TORCH_CHECK(false, "logits must be float32, float64, bfloat16 or float16");
  }
}

LogitsPassResult grpo_loss_from_logits_pass_cuda(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(logits.device());
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/false);
  run_logits_pass(plan, /*grad_in_logits=*/false);
  return plan.result();
}

std::tuple<at::Tensor, at::Tensor> grpo_loss_from_logits_pass_inplace_cuda(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(logits.device());
  check_inplace_logits(logits);
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/true);
  run_logits_pass(plan, /*grad_in_logits=*/true);
  return {plan.logps, plan.entropy};
}

void scale_grad_cuda(at::Tensor& grad, const at::Tensor& factor) {
  TORCH_CHECK(grad.is_cuda(), "grad must be a CUDA tensor for the CUDA kernel");
  TORCH_CHECK(factor.numel() == 1, "factor must have one element, got shape ", factor.sizes());
  check_same_device(factor, grad, "factor", "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const LogitsRows rows = logits_rows(grad);
  if (grad.scalar_type() == at::kDouble) {
    const at::Tensor f = factor.reshape({1}).to(at::kDouble);
    launch_scale_rows<double, double>(rows, f.data_ptr<double>(), stream);
  } else {
    const at::Tensor f = factor.reshape({1}).to(at::kFloat);
    switch (grad.scalar_type()) {
      case at::kFloat: launch_scale_rows<float, float>(rows, f.data_ptr<float>(), stream); break;
      case at::kBFloat16: launch_scale_rows<float, __nv_bfloat16>(rows, f.data_ptr<float>(), stream); break;
      case at::kHalf: launch_scale_rows<float, __half>(rows, f.data_ptr<float>(), stream); break;
      default: TORCH_CHECK(false, "grad must be float32, float64, bfloat16 or float16, got ", grad.scalar_type());
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("grpo_loss_from_logits_pass", &grpo_loss_from_logits_pass_cuda);
  m.impl("grpo_loss_from_logits_pass_", &grpo_loss_from_logits_pass_inplace_cuda);
  m.impl("scale_grad_", &scale_grad_cuda);
}

}  // namespace grpo_ext
