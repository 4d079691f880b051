// grpo_loss_forward and grpo_loss_backward on the emulated device: plan/loss_options.h, plan/grpo_loss.h and
// cuda/grpo_loss.cu without torch.
#include "cuda/grpo_loss.cuh"
#include "driver.h"
#include "loss_plan.h"
#include "option_choices.h"

namespace cuda_emu {

namespace {

using grpo_ext::KLEstimator, grpo_ext::LossType;

// The option strings the bindings accept (csrc/option_choices.h); anything else is a bad request.
template <typename E, size_t N>
E parse(const std::string& value, const grpo_ext::Choice<E> (&choices)[N]) {
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
  }
  bad_args("unknown option value " + value);
}

}  // namespace

LossPlan plan_loss_inputs(int64_t batch, int64_t seq_len, const std::optional<Tensor>& logps, DType acc,
                          const Tensor& advantages, const Tensor& mask, Args& a, bool compute_grad,
                          bool force_token_level) {
  LossPlan plan;
  grpo_ext::LossInputs& in = plan.inputs;
  in.batch = batch;
  in.seq_len = seq_len;
  if (logps) in.logps = matrix_view(*logps, batch, seq_len, false);
  in.advantages = matrix_view(advantages, batch, seq_len, true);
  const bool per_row_advantages = in.advantages.col_stride == 0;
  in.mask = matrix_view(mask, batch, seq_len, false);
  const std::optional<Tensor> old_logps = a.optional_tensor(), ref_logps = a.optional_tensor();
  const std::optional<Tensor> is_weights = a.optional_tensor(), sample_mask = a.optional_tensor();
  if (old_logps) in.old_logps = matrix_view(*old_logps, batch, seq_len, false);
  if (ref_logps) in.ref_logps = matrix_view(*ref_logps, batch, seq_len, false);
  if (is_weights) in.is_weights = matrix_view(*is_weights, batch, seq_len, true);
  if (sample_mask) in.sample_mask = matrix_view(*sample_mask, batch, 1, true);

  grpo_ext::LossParams& p = plan.params;
  p.loss_type = parse(a.string(), grpo_ext::kLossTypeChoices);
  p.epsilon_low = a.number();
  p.epsilon_high = a.number();
  if (const std::optional<double> delta = a.optional_number()) {
    p.has_delta = true;
    p.delta = *delta;
  }
  p.beta = a.number();
  p.kl_estimator = parse(a.string(), grpo_ext::kKLEstimatorChoices);
  if (const std::optional<double> clamp = a.optional_number()) {
    p.has_kl_clamp = true;
    p.kl_clamp = *clamp;
  }
  p.bias_correction = a.boolean();
  p.sequence_level = parse(a.string(), grpo_ext::kSequenceLevelChoices) && !force_token_level;
  p.row_share_metrics = p.sequence_level && per_row_advantages;
  p.per_row_advantages = per_row_advantages;
  p.has_old = old_logps.has_value();
  p.compute_grad = compute_grad;
  plan.max_completion_length = a.integer();
  const std::optional<double> num_items = a.optional_number();
  const std::optional<Tensor> num_items_tensor = a.optional_tensor();
  p.sapo_tau_pos = a.number();
  p.sapo_tau_neg = a.number();
  p.vespo_k_pos = a.number();
  p.vespo_lambda_pos = a.number();
  p.vespo_k_neg = a.number();
  p.vespo_lambda_neg = a.number();
  plan.loss_scale = a.number();
  p.skip_empty_rows = a.boolean();
  const std::optional<Tensor> policy_weights = a.optional_tensor();
  if (policy_weights) in.policy_weights = matrix_view(*policy_weights, batch, seq_len, true);
  if (num_items) {
    plan.has_num_items = true;
    plan.num_items = *num_items;
  } else if (num_items_tensor) {  // a device tensor (every tensor here is one): reshape({1}).to(acc)
    plan.has_num_items = true;
    plan.num_items_device = scalar_tensor(num_items_tensor->item(), acc);
  }
  for (const std::optional<Tensor>& t : {logps, old_logps, ref_logps, is_weights, sample_mask, policy_weights}) {
    if (t) plan.keep.push_back(*t);
  }
  plan.keep.push_back(advantages);
  plan.keep.push_back(mask);
  return plan;
}

namespace {

template <typename T>
void forward_impl(const LossPlan& plan, const Tensor& grad_raw, const Tensor& loss, const Tensor& metrics,
                  const Tensor& grad_scale) {
  const Tensor partials = empty({plan.inputs.batch, grpo_ext::kNumRowSlots}, DType::kFloat64);  // as grpo_loss.cu
  const T* num_items_device = plan.num_items_device ? plan.num_items_device->data_as<T>() : nullptr;
  grpo_ext::launch_grpo_loss_forward<T>(
      plan.params, plan.inputs, plan.max_completion_length, plan.has_num_items, plan.num_items, num_items_device,
      plan.loss_scale, plan.params.compute_grad ? grad_raw.data_as<T>() : nullptr, partials.data_as<double>(),
      loss.data_as<T>(), metrics.data_as<T>(), grad_scale.data_as<T>(), nullptr);
}

std::vector<Tensor> grpo_loss_forward(Args& a) {
  const Tensor logps = a.tensor(), advantages = a.tensor(), mask = a.tensor();
  const int64_t batch = logps.size(0), seq_len = logps.size(1);
  const DType acc = accumulate_type(logps.dtype);
  LossPlan plan = plan_loss_inputs(batch, seq_len, logps, acc, advantages, mask, a, false, false);
  plan.params.compute_grad = a.boolean();
  a.done();
  const bool grad = plan.params.compute_grad;
  Tensor loss = empty({}, acc), metrics = empty({grpo_ext::kNumMetrics}, acc);
  Tensor grad_raw = grad ? empty({batch, seq_len}, acc) : empty({0}, acc), grad_scale = empty({}, acc);
  if (acc == DType::kFloat64) {
    forward_impl<double>(plan, grad_raw, loss, metrics, grad_scale);
  } else {
    forward_impl<float>(plan, grad_raw, loss, metrics, grad_scale);
  }
  return {loss, metrics, grad_raw, grad_scale};
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
