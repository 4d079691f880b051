// grpo_loss_forward and grpo_loss_backward on the emulated device: plan/grpo_loss.h as it is (plans.h), and
// cuda/grpo_loss.cu's launches without torch. Also the plans' arguments from a request (plans.h).
#include <type_traits>

#include "cuda/grpo_loss.cuh"
#include "driver.h"
#include "plans.h"

namespace cuda_emu {

grpo_ext::Tensor tensor_arg(Args& a) {
  return grpo_ext::Tensor(a.tensor());
}

std::optional<grpo_ext::Tensor> optional_tensor_arg(Args& a) {
  const std::optional<Tensor> t = a.optional_tensor();
  if (!t) return std::nullopt;
  return grpo_ext::Tensor(*t);
}

namespace {

// One loss option of the C++ type the plans give it (GRPO_LOSS_OPTIONS).
template <typename T>
T option_arg(Args& a) {
  if constexpr (std::is_same_v<T, std::optional<grpo_ext::Tensor>>) {
    return optional_tensor_arg(a);
  } else if constexpr (std::is_same_v<T, std::string_view>) {
    return a.string();
  } else if constexpr (std::is_same_v<T, std::optional<double>>) {
    return a.optional_number();
  } else if constexpr (std::is_same_v<T, bool>) {
    return a.boolean();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return a.integer();
  } else {
    static_assert(std::is_same_v<T, double>, "a loss option of a type the driver does not read");
    return a.number();
  }
}

}  // namespace

grpo_ext::LossOptionArgs loss_option_args(Args& a) {
  // (a braced list: its elements are read in order)
#define CUDA_EMU_OPTION_ARG(schema_type, cpp_type, name) option_arg<decltype(grpo_ext::LossOptionArgs::name)>(a),
  return grpo_ext::LossOptionArgs{GRPO_LOSS_OPTIONS(CUDA_EMU_OPTION_ARG)};
#undef CUDA_EMU_OPTION_ARG
}

namespace {

template <typename T>
void forward_impl(grpo_ext::LossForwardPlan& plan) {
  const Tensor partials = empty({plan.inputs.batch, grpo_ext::kNumRowSlots}, DType::kFloat64);  // as grpo_loss.cu
  grpo_ext::launch_grpo_loss_forward<T>(
      plan.params, plan.inputs, plan.max_completion_length, plan.has_num_items, plan.num_items_arg<T>(),
      plan.loss_scale_arg<T>(), plan.params.compute_grad ? plan.grad_raw.mutable_data_ptr<T>() : nullptr,
      partials.data_as<double>(), plan.loss.mutable_data_ptr<T>(), plan.metrics.mutable_data_ptr<T>(),
      plan.grad_scale.mutable_data_ptr<T>(), nullptr);
}

}  // namespace

void run_loss_forward(grpo_ext::LossForwardPlan& plan) {
  if (plan.loss.scalar_type() == grpo_ext::ScalarType::Double) {
    forward_impl<double>(plan);
  } else {
    forward_impl<float>(plan);
  }
}

namespace {

std::vector<Tensor> grpo_loss_forward(Args& a) {
  const grpo_ext::Tensor logps = tensor_arg(a), advantages = tensor_arg(a), mask = tensor_arg(a);
  const grpo_ext::LossOptionArgs options = loss_option_args(a);
  const bool compute_grad = a.boolean();
  a.done();
  grpo_ext::LossForwardPlan plan = grpo_ext::plan_grpo_loss(logps, advantages, mask, options, compute_grad);
  run_loss_forward(plan);
  return {plan.loss.emu(), plan.metrics.emu(), plan.grad_raw.emu(), plan.grad_scale.emu()};
}

constexpr int kNumSMs = 132;  // an H100's; only the backward's grid cap depends on it

std::vector<Tensor> grpo_loss_backward(Args& a) {
  const Tensor grad_loss = a.tensor(), grad_raw = a.tensor(), grad_scale = a.tensor();
  const DType out_dtype = a.dtype();
  a.done();
  const Tensor grad_loss_acc = scalar_tensor(grad_loss.item(), grad_raw.dtype);
  Tensor out = empty(grad_raw.sizes, out_dtype);
  const int64_t n = grad_raw.numel();
  if (grad_raw.dtype == DType::kFloat64) {
    if (out_dtype != DType::kFloat64) bad_args("a float64 gradient is written as float64 only");
    grpo_ext::launch_grpo_loss_backward<double, double>(grad_raw.data_as<double>(), grad_loss_acc.data_as<double>(),
                                                        grad_scale.data_as<double>(), out.data_as<double>(), n, kNumSMs,
                                                        nullptr);
    return {out};
  }
  const float* g = grad_raw.data_as<float>();
  const float* gl = grad_loss_acc.data_as<float>();
  const float* gs = grad_scale.data_as<float>();
  switch (out_dtype) {
    case DType::kFloat32:
      grpo_ext::launch_grpo_loss_backward<float, float>(g, gl, gs, out.data_as<float>(), n, kNumSMs, nullptr);
      break;
    case DType::kBFloat16:
      grpo_ext::launch_grpo_loss_backward<float, __nv_bfloat16>(g, gl, gs, out.data_as<__nv_bfloat16>(), n, kNumSMs,
                                                                nullptr);
      break;
    case DType::kFloat16:
      grpo_ext::launch_grpo_loss_backward<float, __half>(g, gl, gs, out.data_as<__half>(), n, kNumSMs, nullptr);
      break;
    default: bad_args("out_dtype must be float32, bfloat16 or float16 for a float32 gradient");
  }
  return {out};
}

const RegisterOp kForward("grpo_loss_forward", grpo_loss_forward);
const RegisterOp kBackward("grpo_loss_backward", grpo_loss_backward);

}  // namespace
}  // namespace cuda_emu
