// CUDA binding of the fused GRPO loss from logits: validate, allocate, pick the dtypes, launch on the current stream.

#include "../plan/logits_loss.h"
#include "device.h"
#include "grpo_loss_from_logits.cuh"
#include "kept_entropy.cuh"

namespace grpo_ext {
namespace {

// What the current device offers the single-read pass (attribute queries: no sync), and the layout the environment
// asks for (with_layout_from_env: the two-read pass unless GRPO_EXT_LOGITS_SINGLE_READ=1, ...). The small-block
// layout's clusters of up to 16 blocks (the non-portable size) only on a device that launches clusters (sm_90 and
// newer); whether one such cluster fits a GPC is asked at launch (launch_small_blocks).
RowResidency row_residency(const CudaCall& call) {
  const int shared = call.attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int shared_per_sm = call.attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  const int major = call.attribute(cudaDevAttrComputeCapabilityMajor);
  const bool clusters = major >= 9 && call.attribute(cudaDevAttrClusterLaunch) != 0;
  RowResidency device;
  device.shared_per_block = static_cast<size_t>(shared);
  device.shared_per_sm = static_cast<size_t>(shared_per_sm);
  device.max_cluster_blocks = clusters ? 16u : 1u;
  return with_layout_from_env(device);
}

template <typename T, typename In>
void run_pass(LogitsPassPlan& plan, bool grad_in_logits, const CudaCall& call) {
  const cudaStream_t stream = call.stream();
  LogitsPassArgs args{plan.loss.params,
                      plan.loss.inputs,
                      plan.logits,
                      plan.ids,
                      plan.token_grad,
                      plan.row_offset,
                      plan.compute_grad && plan.grad_data != nullptr,
                      grad_in_logits,
                      plan.compute_grad && plan.grad_data != nullptr && plan.entropy_coef != 0.0,
                      plan.entropy_weights};
  Tensor row_weight;  // [B + 1]: the rows' weights, then the entropy bonus' (row_weights_kernel)
  if (args.compute_grad && (!plan.token_grad.present() || args.entropy_bonus)) {
    row_weight = new_empty(plan.logps, {plan.loss.inputs.batch + 1}, plan.logps.scalar_type());
    const LossForwardPlan& lp = plan.loss;
    launch_grpo_loss_from_logits_row_weights<T>(lp.params, lp.inputs, lp.max_completion_length, lp.has_num_items,
                                                lp.num_items_arg<T>(), lp.loss_scale_arg<T>(), T(plan.entropy_coef),
                                                plan.entropy_weights, row_weight.mutable_data_ptr<T>(), stream);
    check_launch();
  }
  launch_grpo_loss_from_logits<T, In>(args, plan.logit.transform<T>(),
                                      row_weight.defined() ? row_weight.mutable_data_ptr<T>() : nullptr,
                                      static_cast<In*>(plan.grad_data), plan.logps.mutable_data_ptr<T>(),
                                      plan.entropy.mutable_data_ptr<T>(), row_residency(call), stream);
  check_launch();
}

void run_logits_pass(LogitsPassPlan& plan, bool grad_in_logits, const CudaCall& call) {
  switch (plan.logits.dtype) {
    case DType::kFloat64: run_pass<double, double>(plan, grad_in_logits, call); break;
    case DType::kFloat32: run_pass<float, float>(plan, grad_in_logits, call); break;
    case DType::kBFloat16: run_pass<float, __nv_bfloat16>(plan, grad_in_logits, call); break;
    case DType::kFloat16: run_pass<float, __half>(plan, grad_in_logits, call); break;
    default: GRPO_CHECK(false, "logits must be float32, float64, bfloat16 or float16");
  }
}

LogitsPassResult grpo_loss_from_logits_pass_cuda(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  const CudaCall call(logits, "logits");
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/false);
  run_logits_pass(plan, /*grad_in_logits=*/false, call);
  return plan.result();
}

std::tuple<Tensor, Tensor> grpo_loss_from_logits_pass_inplace_cuda(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  const CudaCall call(logits, "logits");
  check_inplace_logits(logits);
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/true);
  run_logits_pass(plan, /*grad_in_logits=*/true, call);
  return {plan.logps, plan.entropy};
}

// The CUDA kernels of logits_loss (plan/logits_loss.h), on the call's device and stream.
struct CudaLogitsLoss {
  const CudaCall& call;
  void pass(LogitsPassPlan& plan, bool grad_in_logits) { run_logits_pass(plan, grad_in_logits, call); }
  void loss(LossForwardPlan& plan) { run_loss_forward_cuda(plan, call.stream()); }
  Tensor entropy(const LogitsPassPlan& plan, double entropy_coef, Tensor& loss) {
    const Tensor& entropy = plan.entropy;
    Tensor mean = new_empty(entropy, {}, entropy.scalar_type());
    if (entropy.scalar_type() == ScalarType::Double) {
      launch_kept_entropy_mean<double>(plan.loss.inputs, plan.entropy_weights, entropy.const_data_ptr<double>(),
                                       entropy_coef, plan.loss.loss_scale_arg<double>(),
                                       loss.mutable_data_ptr<double>(), mean.mutable_data_ptr<double>(), call.stream());
    } else {
      launch_kept_entropy_mean<float>(plan.loss.inputs, plan.entropy_weights, entropy.const_data_ptr<float>(),
                                      entropy_coef, plan.loss.loss_scale_arg<float>(), loss.mutable_data_ptr<float>(),
                                      mean.mutable_data_ptr<float>(), call.stream());
    }
    check_launch();
    return mean;
  }
};

LogitsLossResult grpo_loss_from_logits_cuda(GRPO_LOGITS_LOSS_PARAMS) {
  const CudaCall call(logits, "logits");
  CudaLogitsLoss device{call};
  return logits_loss(device, GRPO_LOGITS_LOSS_ARGS, /*inplace=*/false);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> grpo_loss_from_logits_inplace_cuda(GRPO_LOGITS_LOSS_PARAMS) {
  const CudaCall call(logits, "logits");
  check_inplace_logits(logits);
  CudaLogitsLoss device{call};
  auto [loss, metrics, mean, grad, logps, entropy] = logits_loss(device, GRPO_LOGITS_LOSS_ARGS, /*inplace=*/true);
  return {loss, metrics, mean, logps, entropy};
}

void scale_grad_cuda(Tensor& grad, const Tensor& factor) {
  const CudaCall call(grad, "grad");
  GRPO_CHECK(factor.numel() == 1, "factor must have one element, got shape ", shape(factor));
  check_same_device(factor, grad, "factor", "grad");
  const cudaStream_t stream = call.stream();
  const LogitsRows rows = logits_rows(grad);
  if (grad.scalar_type() == ScalarType::Double) {
    const Tensor f = torch::stable::to(torch::stable::reshape(factor, {1}), ScalarType::Double);
    launch_scale_rows<double, double>(rows, f.mutable_data_ptr<double>(), stream);
  } else {
    const Tensor f = torch::stable::to(torch::stable::reshape(factor, {1}), ScalarType::Float);
    switch (grad.scalar_type()) {
      case ScalarType::Float: launch_scale_rows<float, float>(rows, f.mutable_data_ptr<float>(), stream); break;
      case ScalarType::BFloat16:
        launch_scale_rows<float, __nv_bfloat16>(rows, f.mutable_data_ptr<float>(), stream);
        break;
      case ScalarType::Half: launch_scale_rows<float, __half>(rows, f.mutable_data_ptr<float>(), stream); break;
      default: GRPO_CHECK(false, "grad must be float32, float64, bfloat16 or float16, got ", grad.scalar_type());
    }
  }
  check_launch();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("grpo_loss_from_logits_pass", TORCH_BOX(&grpo_loss_from_logits_pass_cuda));
  m.impl("grpo_loss_from_logits_pass_", TORCH_BOX(&grpo_loss_from_logits_pass_inplace_cuda));
  m.impl("scale_grad_", TORCH_BOX(&scale_grad_cuda));
  m.impl("grpo_loss_from_logits", TORCH_BOX(&grpo_loss_from_logits_cuda));
  m.impl("grpo_loss_from_logits_", TORCH_BOX(&grpo_loss_from_logits_inplace_cuda));
}

}  // namespace grpo_ext
