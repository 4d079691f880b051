// selective_log_softmax and grpo_loss_from_logits on the emulated device: selective_log_softmax's plan and binding
// mirrored without torch (plan/selective_log_softmax.h, cuda/selective_log_softmax.cu); the fused pass and the whole
// op through their plans as they are (plan/grpo_loss_from_logits.h, plan/logits_loss.h; plans.h), launched as
// cuda/grpo_loss_from_logits.cu launches them.

#include "cuda/grpo_loss_from_logits.cuh"
#include "cuda/kept_entropy.cuh"
#include "cuda/selective_log_softmax.cuh"
#include "driver.h"
#include "plans.h"

namespace cuda_emu {
namespace {

// The ops' (temperature, logit_scale, logit_softcap) arguments (logit_softcap 0: no cap; docs/math.md section 2).
struct LogitArgs {
  double temperature, logit_scale, logit_softcap;
  template <typename T>
  grpo_ext::LogitTransform<T> transform() const {
    return grpo_ext::make_logit_transform<T>(temperature, logit_scale, logit_softcap);
  }
};

LogitArgs logit_args(Args& a) {
  const double temperature = a.number(), logit_scale = a.number(), logit_softcap = a.number();
  return {temperature, logit_scale, logit_softcap};
}

std::vector<Tensor> selective_log_softmax_forward(Args& a) {
  const Tensor logits = a.tensor(), ids = a.tensor();
  const LogitArgs logit = logit_args(a);
  const bool return_entropy = a.boolean();
  a.done();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const grpo_ext::StridedMatrix x = matrix_view(logits, rows, vocab, false), id = matrix_view(ids, rows, 1, true);
  const DType acc = accumulate_type(logits.dtype);
  Tensor logps = empty({rows}, acc), entropy = return_entropy ? empty({rows}, acc) : empty({0}, acc);
  Tensor row_stats = empty({rows, grpo_ext::kSoftmaxStats}, acc);
  if (acc == DType::kFloat64) {
    grpo_ext::launch_selective_log_softmax_forward<double>(
        x, id, rows, vocab, logit.transform<double>(), logps.data_as<double>(),
        return_entropy ? entropy.data_as<double>() : nullptr, row_stats.data_as<double>(), nullptr);
  } else {
    grpo_ext::launch_selective_log_softmax_forward<float>(
        x, id, rows, vocab, logit.transform<float>(), logps.data_as<float>(),
        return_entropy ? entropy.data_as<float>() : nullptr, row_stats.data_as<float>(), nullptr);
  }
  return {logps, entropy, row_stats};
}

std::vector<Tensor> selective_log_softmax_backward(Args& a) {
  const Tensor grad_logps = a.tensor();
  const std::optional<Tensor> grad_entropy = a.optional_tensor();
  const Tensor logits = a.tensor(), ids = a.tensor(), row_stats = a.tensor();
  const LogitArgs logit = logit_args(a);
  a.done();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const grpo_ext::StridedMatrix x = matrix_view(logits, rows, vocab, false), id = matrix_view(ids, rows, 1, true);
  const grpo_ext::StridedMatrix gl = matrix_view(grad_logps, rows, 1, true);
  grpo_ext::StridedMatrix gh;
  if (grad_entropy) gh = matrix_view(*grad_entropy, rows, 1, true);
  Tensor grad = empty({rows, vocab}, logits.dtype);
  const grpo_ext::LogitTransform<float> f = logit.transform<float>();
  switch (logits.dtype) {
    case DType::kFloat64:
      grpo_ext::launch_selective_log_softmax_backward<double, double>(x, id, gl, gh, row_stats.data_as<double>(), rows,
                                                                      vocab, logit.transform<double>(),
                                                                      grad.data_as<double>(), nullptr);
      break;
    case DType::kFloat32:
      grpo_ext::launch_selective_log_softmax_backward<float, float>(x, id, gl, gh, row_stats.data_as<float>(), rows,
                                                                    vocab, f, grad.data_as<float>(), nullptr);
      break;
    case DType::kBFloat16:
      grpo_ext::launch_selective_log_softmax_backward<float, __nv_bfloat16>(
          x, id, gl, gh, row_stats.data_as<float>(), rows, vocab, f, grad.data_as<__nv_bfloat16>(), nullptr);
      break;
    default:
      grpo_ext::launch_selective_log_softmax_backward<float, __half>(x, id, gl, gh, row_stats.data_as<float>(), rows,
                                                                     vocab, f, grad.data_as<__half>(), nullptr);
      break;
  }
  return {grad};
}

// What the emulated device offers the single-read pass (its limits come from the driver's command line), as the
// CUDA binding's row_residency: clusters of up to 16 on any device that launches clusters (of more than one block),
// whether one fits asked at launch (GRPO_MAX_ACTIVE_CLUSTERS). The layout variables (GRPO_EXT_LOGITS_*) are read as
// the binding reads them.
grpo_ext::RowResidency row_residency() {
  const DeviceLimits& d = device_limits();
  grpo_ext::RowResidency residency;
  residency.shared_per_block = d.max_shared_per_block;
  residency.shared_per_sm = d.shared_per_sm;
  residency.max_cluster_blocks = d.max_cluster_blocks == 0 ? 0u : d.max_cluster_blocks > 1 ? 16u : 1u;
  return grpo_ext::with_layout_from_env(residency);
}

// cuda/grpo_loss_from_logits.cu's run_pass: the row weights (token-level gradient), then the pass.
template <typename T, typename In>
void run_pass(grpo_ext::LogitsPassPlan& plan, bool grad_in_logits) {
  const bool with_grad = plan.compute_grad && plan.grad_data != nullptr;
  const grpo_ext::LogitsPassArgs args{plan.loss.params,
                                      plan.loss.inputs,
                                      plan.logits,
                                      plan.ids,
                                      plan.token_grad,
                                      plan.row_offset,
                                      with_grad,
                                      grad_in_logits,
                                      with_grad && plan.entropy_coef != 0.0,
                                      plan.entropy_weights};
  grpo_ext::Tensor row_weight;  // [B + 1]: the rows' weights, then the entropy bonus'
  if (args.compute_grad && (!plan.token_grad.present() || args.entropy_bonus)) {
    row_weight = grpo_ext::new_empty(plan.logps, {plan.loss.inputs.batch + 1}, plan.logps.scalar_type());
    const grpo_ext::LossForwardPlan& lp = plan.loss;
    grpo_ext::launch_grpo_loss_from_logits_row_weights<T>(
        lp.params, lp.inputs, lp.max_completion_length, lp.has_num_items, lp.num_items_arg<T>(), lp.loss_scale_arg<T>(),
        T(plan.entropy_coef), plan.entropy_weights, row_weight.mutable_data_ptr<T>(), nullptr);
  }
  grpo_ext::launch_grpo_loss_from_logits<T, In>(args, plan.logit.transform<T>(),
                                                row_weight.defined() ? row_weight.mutable_data_ptr<T>() : nullptr,
                                                static_cast<In*>(plan.grad_data), plan.logps.mutable_data_ptr<T>(),
                                                plan.entropy.mutable_data_ptr<T>(), row_residency(), nullptr);
}

void run_logits_pass(grpo_ext::LogitsPassPlan& plan, bool grad_in_logits) {
  switch (plan.logits.dtype) {
    case DType::kFloat64: run_pass<double, double>(plan, grad_in_logits); break;
    case DType::kFloat32: run_pass<float, float>(plan, grad_in_logits); break;
    case DType::kBFloat16: run_pass<float, __nv_bfloat16>(plan, grad_in_logits); break;
    case DType::kFloat16: run_pass<float, __half>(plan, grad_in_logits); break;
    default: bad_args("logits must be float32, float64, bfloat16 or float16");
  }
}

// grpo_loss_from_logits_pass (a new gradient tensor) and grpo_loss_from_logits_pass_ (the gradient over the logits).
std::vector<Tensor> logits_pass(Args& a, bool inplace) {
  const grpo_ext::Tensor logits = tensor_arg(a), ids = tensor_arg(a);
  const int64_t row_offset = a.integer();
  const grpo_ext::Tensor advantages = tensor_arg(a), mask = tensor_arg(a);
  const std::optional<grpo_ext::Tensor> token_grad = optional_tensor_arg(a);
  const grpo_ext::LossOptionArgs options = loss_option_args(a);
  const double temperature = a.number(), logit_scale = a.number(), logit_softcap = a.number();
  const double entropy_coef = a.number();
  const std::optional<grpo_ext::Tensor> entropy_weights = optional_tensor_arg(a);
  const bool compute_grad = a.boolean();
  a.done();
  if (inplace) grpo_ext::check_inplace_logits(logits);
  grpo_ext::LogitsPassPlan plan = grpo_ext::plan_grpo_loss_from_logits(
      logits, ids, row_offset, advantages, mask, token_grad, options, temperature, logit_scale, logit_softcap,
      entropy_coef, entropy_weights, compute_grad, inplace);
  run_logits_pass(plan, /*grad_in_logits=*/inplace);
  if (inplace) return {plan.logps.emu(), plan.entropy.emu(), logits.emu()};  // the written argument last
  return {plan.logps.emu(), plan.entropy.emu(), plan.grad_logits.emu()};
}

std::vector<Tensor> logits_pass_new(Args& a) {
  return logits_pass(a, false);
}
std::vector<Tensor> logits_pass_inplace(Args& a) {
  return logits_pass(a, true);
}

// The emulated device's kernels of plan/logits_loss.h (cuda/grpo_loss_from_logits.cu's CudaLogitsLoss).
struct EmuLogitsLoss {
  void pass(grpo_ext::LogitsPassPlan& plan, bool grad_in_logits) { run_logits_pass(plan, grad_in_logits); }
  void loss(grpo_ext::LossForwardPlan& plan) { run_loss_forward(plan); }
  grpo_ext::Tensor entropy(const grpo_ext::LogitsPassPlan& plan, double entropy_coef, grpo_ext::Tensor& loss) {
    const grpo_ext::Tensor& entropy = plan.entropy;
    grpo_ext::Tensor mean = grpo_ext::new_empty(entropy, {}, entropy.scalar_type());
    if (entropy.scalar_type() == grpo_ext::ScalarType::Double) {
      grpo_ext::launch_kept_entropy_mean<double>(plan.loss.inputs, plan.entropy_weights,
                                                 entropy.const_data_ptr<double>(), entropy_coef,
                                                 plan.loss.loss_scale_arg<double>(), loss.mutable_data_ptr<double>(),
                                                 mean.mutable_data_ptr<double>(), nullptr);
    } else {
      grpo_ext::launch_kept_entropy_mean<float>(
          plan.loss.inputs, plan.entropy_weights, entropy.const_data_ptr<float>(), entropy_coef,
          plan.loss.loss_scale_arg<float>(), loss.mutable_data_ptr<float>(), mean.mutable_data_ptr<float>(), nullptr);
    }
    return mean;
  }
};

// grpo_loss_from_logits and grpo_loss_from_logits_: plan/logits_loss.h's logits_loss on this device.
std::vector<Tensor> logits_loss(Args& a, bool inplace) {
  const grpo_ext::Tensor logits = tensor_arg(a), ids = tensor_arg(a), advantages = tensor_arg(a), mask = tensor_arg(a);
  const grpo_ext::LossOptionArgs options = loss_option_args(a);
  const double temperature = a.number(), logit_scale = a.number(), logit_softcap = a.number();
  const double entropy_coef = a.number();
  const std::optional<grpo_ext::Tensor> entropy_weights = optional_tensor_arg(a);
  const bool compute_grad = a.boolean();
  a.done();
  if (inplace) grpo_ext::check_inplace_logits(logits);
  EmuLogitsLoss device;
  const auto [loss, metrics, mean, grad, logps, entropy] =
      grpo_ext::logits_loss(device, logits, ids, advantages, mask, options, temperature, logit_scale, logit_softcap,
                            entropy_coef, entropy_weights, compute_grad, inplace);
  if (inplace) return {loss.emu(), metrics.emu(), mean.emu(), logps.emu(), entropy.emu(), logits.emu()};
  return {loss.emu(), metrics.emu(), mean.emu(), grad.emu(), logps.emu(), entropy.emu()};
}

std::vector<Tensor> logits_loss_new(Args& a) {
  return logits_loss(a, false);
}
std::vector<Tensor> logits_loss_inplace(Args& a) {
  return logits_loss(a, true);
}

std::vector<Tensor> scale_grad(Args& a) {
  const Tensor grad = a.tensor(), factor = a.tensor();
  a.done();
  const grpo_ext::LogitsRows rows = logits_rows(grad);
  if (grad.dtype == DType::kFloat64) {
    const Tensor f = scalar_tensor(factor.item(), DType::kFloat64);
    grpo_ext::launch_scale_rows<double, double>(rows, f.data_as<double>(), nullptr);
    return {grad};
  }
  const Tensor f = scalar_tensor(factor.item(), DType::kFloat32);
  switch (grad.dtype) {
    case DType::kFloat32: grpo_ext::launch_scale_rows<float, float>(rows, f.data_as<float>(), nullptr); break;
    case DType::kBFloat16: grpo_ext::launch_scale_rows<float, __nv_bfloat16>(rows, f.data_as<float>(), nullptr); break;
    case DType::kFloat16: grpo_ext::launch_scale_rows<float, __half>(rows, f.data_as<float>(), nullptr); break;
    default: bad_args("grad must be float32, float64, bfloat16 or float16");
  }
  return {grad};
}

const RegisterOp kSoftmaxForward("selective_log_softmax_forward", selective_log_softmax_forward);
const RegisterOp kSoftmaxBackward("selective_log_softmax_backward", selective_log_softmax_backward);
const RegisterOp kPass("grpo_loss_from_logits_pass", logits_pass_new);
const RegisterOp kPassInplace("grpo_loss_from_logits_pass_", logits_pass_inplace);
const RegisterOp kScaleGrad("scale_grad_", scale_grad);
const RegisterOp kLogitsLoss("grpo_loss_from_logits", logits_loss_new);
const RegisterOp kLogitsLossInplace("grpo_loss_from_logits_", logits_loss_inplace);

}  // namespace
}  // namespace cuda_emu
