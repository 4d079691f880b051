// CUDA binding of the fused GRPO loss: validate, allocate, pick the dtype, launch on the current stream.

#include "../plan/grpo_loss.h"
#include "device.h"
#include "grpo_loss.cuh"

namespace grpo_ext {
namespace {

template <typename T>
void forward_impl(LossForwardPlan& plan, cudaStream_t stream) {
  // The row partials in float64 whatever T: they are summed as the CPU kernel sums them (grpo_loss.cuh).
  Tensor partials = new_empty(plan.loss, {plan.inputs.batch, kNumRowSlots}, ScalarType::Double);
  launch_grpo_loss_forward<T>(plan.params, plan.inputs, plan.max_completion_length, plan.has_num_items,
                              plan.num_items_arg<T>(), plan.loss_scale_arg<T>(),
                              plan.params.compute_grad ? plan.grad_raw.mutable_data_ptr<T>() : nullptr,
                              partials.mutable_data_ptr<double>(), plan.loss.mutable_data_ptr<T>(),
                              plan.metrics.mutable_data_ptr<T>(), plan.grad_scale.mutable_data_ptr<T>(), stream);
  check_launch();
}

}  // namespace

void run_loss_forward_cuda(LossForwardPlan& plan, cudaStream_t stream) {
  if (plan.loss.scalar_type() == ScalarType::Double) {
    forward_impl<double>(plan, stream);
  } else {
    forward_impl<float>(plan, stream);
  }
}

namespace {

LossForwardResult grpo_loss_forward_cuda(GRPO_LOSS_FORWARD_PARAMS) {
  const CudaCall call(logps, "logps");
  LossForwardPlan plan = plan_grpo_loss(GRPO_LOSS_FORWARD_ARGS);
  run_loss_forward_cuda(plan, call.stream());
  return plan.result();
}

Tensor grpo_loss_backward_cuda(const Tensor& grad_loss, const Tensor& grad_raw, const Tensor& grad_scale,
                               ScalarType out_dtype) {
  check_loss_backward(grad_loss, grad_raw, grad_scale, out_dtype);
  const CudaCall call(grad_raw, "grad_raw");
  const cudaStream_t stream = call.stream();
  const int num_sms = call.attribute(cudaDevAttrMultiProcessorCount);
  const Tensor grad_loss_acc = torch::stable::to(torch::stable::reshape(grad_loss, {1}), grad_raw.scalar_type());
  Tensor out = new_empty(grad_raw, grad_raw.sizes(), out_dtype);
  const int64_t n = grad_raw.numel();
  if (grad_raw.scalar_type() == ScalarType::Double) {
    GRPO_CHECK(out_dtype == ScalarType::Double, "a float64 gradient is written as float64 only");
    launch_grpo_loss_backward<double, double>(
        grad_raw.mutable_data_ptr<double>(), grad_loss_acc.mutable_data_ptr<double>(),
        grad_scale.mutable_data_ptr<double>(), out.mutable_data_ptr<double>(), n, num_sms, stream);
  } else {
    const float* g = grad_raw.mutable_data_ptr<float>();
    const float* gl = grad_loss_acc.mutable_data_ptr<float>();
    const float* gs = grad_scale.mutable_data_ptr<float>();
    switch (out_dtype) {
      case ScalarType::Float:
        launch_grpo_loss_backward<float, float>(g, gl, gs, out.mutable_data_ptr<float>(), n, num_sms, stream);
        break;
      case ScalarType::BFloat16:
        launch_grpo_loss_backward<float, __nv_bfloat16>(
            g, gl, gs, reinterpret_cast<__nv_bfloat16*>(out.mutable_data_ptr<BFloat16>()), n, num_sms, stream);
        break;
      case ScalarType::Half:
        launch_grpo_loss_backward<float, __half>(g, gl, gs, reinterpret_cast<__half*>(out.mutable_data_ptr<Half>()), n,
                                                 num_sms, stream);
        break;
      default:
        GRPO_CHECK(false, "out_dtype must be float32, bfloat16 or float16 for a float32 gradient, got ", out_dtype);
    }
  }
  check_launch();
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("grpo_loss_forward", TORCH_BOX(&grpo_loss_forward_cuda));
  m.impl("grpo_loss_backward", TORCH_BOX(&grpo_loss_backward_cuda));
}

}  // namespace grpo_ext
