// CUDA binding of the fused GRPO loss: validate, allocate, pick the dtype, launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../plan/grpo_loss.h"
#include "grpo_loss.cuh"

namespace grpo_ext {
namespace {

int multiprocessor_count(c10::DeviceIndex device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <typename T>
void forward_impl(LossForwardPlan& plan, cudaStream_t stream) {
  at::Tensor partials = at::empty({plan.inputs.batch, kNumRowSlots}, plan.loss.options());
  const T* num_items_device = plan.num_items_device.defined() ? plan.num_items_device.data_ptr<T>() : nullptr;
  launch_grpo_loss_forward<T>(
      plan.params, plan.inputs, plan.max_completion_length, plan.has_num_items, T(plan.num_items), num_items_device,
      T(plan.loss_scale), plan.params.compute_grad ? plan.grad_raw.data_ptr<T>() : nullptr, partials.data_ptr<T>(),
      plan.loss.data_ptr<T>(), plan.metrics.data_ptr<T>(), plan.grad_scale.data_ptr<T>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

LossForwardResult grpo_loss_forward_cuda(GRPO_LOSS_FORWARD_PARAMS) {
  TORCH_CHECK(logps.is_cuda(), "logps must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(logps.device());
  LossForwardPlan plan = plan_grpo_loss(GRPO_LOSS_FORWARD_ARGS);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (plan.loss.scalar_type() == at::kDouble) {
    forward_impl<double>(plan, stream);
  } else {
    forward_impl<float>(plan, stream);
  }
  return plan.result();
}

at::Tensor grpo_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& grad_raw,
                                   const at::Tensor& grad_scale, at::ScalarType out_dtype) {
  check_loss_backward(grad_loss, grad_raw, grad_scale, out_dtype);
  TORCH_CHECK(grad_raw.is_cuda(), "grad_raw must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(grad_raw.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int num_sms = multiprocessor_count(grad_raw.device().index());
  const at::Tensor grad_loss_acc = grad_loss.reshape({1}).to(grad_raw.scalar_type());
  at::Tensor out = at::empty(grad_raw.sizes(), grad_raw.options().dtype(out_dtype));
  const int64_t n = grad_raw.numel();
  if (grad_raw.scalar_type() == at::kDouble) {
    TORCH_CHECK(out_dtype == at::kDouble, "a float64 gradient is written as float64 only");
    launch_grpo_loss_backward<double, double>(grad_raw.data_ptr<double>(), grad_loss_acc.data_ptr<double>(),
                                              grad_scale.data_ptr<double>(), out.data_ptr<double>(), n, num_sms,
                                              stream);
  } else {
    const float* g = grad_raw.data_ptr<float>();
    const float* gl = grad_loss_acc.data_ptr<float>();
    const float* gs = grad_scale.data_ptr<float>();
    switch (out_dtype) {
      case at::kFloat:
        launch_grpo_loss_backward<float, float>(g, gl, gs, out.data_ptr<float>(), n, num_sms, stream);
        break;
      case at::kBFloat16:
        launch_grpo_loss_backward<float, __nv_bfloat16>(
            g, gl, gs, reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), n, num_sms, stream);
        break;
      case at::kHalf:
        launch_grpo_loss_backward<float, __half>(g, gl, gs, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), n,
                                                 num_sms, stream);
        break;
      default:
        TORCH_CHECK(false, "out_dtype must be float32, bfloat16 or float16 for a float32 gradient, got ", out_dtype);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("grpo_loss_forward", &grpo_loss_forward_cuda);
  m.impl("grpo_loss_backward", &grpo_loss_backward_cuda);
}

}  // namespace grpo_ext
