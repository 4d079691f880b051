// selective_log_softmax and the fused logits pass on the emulated device: plan/selective_log_softmax.h,
// plan/grpo_loss_from_logits.h, cuda/selective_log_softmax.cu and cuda/grpo_loss_from_logits.cu without torch.
#include <cstdlib>

#include "cuda/grpo_loss_from_logits.cuh"
#include "cuda/kept_entropy.cuh"
#include "cuda/selective_log_softmax.cuh"
#include "driver.h"
#include "loss_plan.h"

namespace cuda_emu {
namespace {

constexpr int kSoftmaxStats = 2;

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
  Tensor row_stats = empty({rows, kSoftmaxStats}, acc);
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

// What the emulated device offers the single-read pass (its limits come from the driver's command line).
// CUDA_EMU_CLAIM_MAX_CLUSTER=n tells the launcher that clusters of n blocks fit where the device takes fewer: a GPU
// that reports sm_90 and then refuses the cluster (no GPC free for it), to test the launcher's fallback. The layout
// variables (GRPO_EXT_LOGITS_THREADS, ..._RESIDENT_BLOCKS_PER_SM) are read as the CUDA binding reads them.
grpo_ext::RowResidency row_residency() {
  const DeviceLimits& d = device_limits();
  grpo_ext::RowResidency residency{d.max_shared_per_block, d.max_cluster_blocks};
  if (const char* claim = std::getenv("CUDA_EMU_CLAIM_MAX_CLUSTER")) {
    residency.max_cluster_blocks = static_cast<unsigned>(std::strtoul(claim, nullptr, 10));
  }
  return grpo_ext::with_layout_from_env(residency);
}

// The entropy bonus' arguments: its coefficient and the weights of the tokens in its mean (absent: every kept one).
struct EntropyBonus {
  double coef = 0.0;
  grpo_ext::StridedMatrix weights;
};

// cuda/grpo_loss_from_logits.cu's run_pass: the row weights (token-level gradient), then the pass.
template <typename T, typename In>
void run_pass(const LossPlan& loss, const grpo_ext::LogitsRows& logits, const grpo_ext::StridedMatrix& ids,
              const grpo_ext::StridedMatrix& token_grad, int64_t row_offset, bool compute_grad, bool grad_in_logits,
              void* grad_data, const LogitArgs& logit, const EntropyBonus& bonus, const Tensor& logps,
              const Tensor& entropy) {
  const bool with_grad = compute_grad && grad_data != nullptr;
  const grpo_ext::LogitsPassArgs args{loss.params,  loss.inputs,    logits,
                                      ids,          token_grad,     row_offset,
                                      with_grad,    grad_in_logits, with_grad && bonus.coef != 0.0,
                                      bonus.weights};
  std::optional<Tensor> row_weight;  // [B + 1]: the rows' weights, then the entropy bonus'
  if (args.compute_grad && (!token_grad.present() || args.entropy_bonus)) {
    row_weight = empty({loss.inputs.batch + 1}, logps.dtype);
    const T* num_items_device = loss.num_items_device ? loss.num_items_device->data_as<T>() : nullptr;
    grpo_ext::launch_grpo_loss_from_logits_row_weights<T>(
        loss.params, loss.inputs, loss.max_completion_length, loss.has_num_items, T(loss.num_items), num_items_device,
        T(loss.loss_scale), T(bonus.coef), bonus.weights, row_weight->data_as<T>(), nullptr);
  }
  grpo_ext::launch_grpo_loss_from_logits<T, In>(
      args, logit.transform<T>(), row_weight ? row_weight->data_as<T>() : nullptr, static_cast<In*>(grad_data),
      logps.data_as<T>(), entropy.data_as<T>(), row_residency(), nullptr);
}

// grpo_loss_from_logits_pass (a new gradient tensor) and grpo_loss_from_logits_pass_ (the gradient over the logits).
std::vector<Tensor> logits_pass(Args& a, bool inplace) {
  const Tensor logits = a.tensor(), ids = a.tensor();
  const int64_t row_offset = a.integer();
  const Tensor advantages = a.tensor(), mask = a.tensor();
  const std::optional<Tensor> token_grad = a.optional_tensor();
  const int64_t batch = mask.size(0), seq_len = mask.size(1);
  const grpo_ext::LogitsRows rows = logits_rows(logits);
  const DType acc = accumulate_type(logits.dtype);
  const LossPlan loss = plan_loss_inputs(batch, seq_len, std::nullopt, acc, advantages, mask, a, false, true);
  const LogitArgs logit = logit_args(a);
  EntropyBonus bonus;
  bonus.coef = a.number();
  const std::optional<Tensor> entropy_weights = a.optional_tensor();
  if (entropy_weights) bonus.weights = matrix_view(*entropy_weights, batch, seq_len, false);
  const bool compute_grad = a.boolean();
  a.done();
  const grpo_ext::StridedMatrix id = matrix_view(ids, rows.rows, 1, true);
  grpo_ext::StridedMatrix tg;
  if (token_grad) tg = matrix_view(*token_grad, rows.rows, 1, true);
  Tensor logps = empty({rows.rows}, acc), entropy = empty({rows.rows}, acc);
  Tensor grad = empty({0}, logits.dtype);
  void* grad_data = nullptr;
  if (inplace) {
    grad_data = logits.data();
  } else if (compute_grad) {
    grad = empty({rows.rows, rows.vocab}, logits.dtype);
    grad_data = grad.numel() > 0 ? grad.data() : nullptr;  // at::empty's data_ptr is null without elements
  }
  switch (logits.dtype) {
    case DType::kFloat64:
      run_pass<double, double>(loss, rows, id, tg, row_offset, compute_grad, inplace, grad_data, logit, bonus, logps,
                               entropy);
      break;
    case DType::kFloat32:
      run_pass<float, float>(loss, rows, id, tg, row_offset, compute_grad, inplace, grad_data, logit, bonus, logps,
                             entropy);
      break;
    case DType::kBFloat16:
      run_pass<float, __nv_bfloat16>(loss, rows, id, tg, row_offset, compute_grad, inplace, grad_data, logit, bonus,
                                     logps, entropy);
      break;
    case DType::kFloat16:
      run_pass<float, __half>(loss, rows, id, tg, row_offset, compute_grad, inplace, grad_data, logit, bonus, logps,
                              entropy);
      break;
    default: bad_args("logits must be float32, float64, bfloat16 or float16");
  }
  if (inplace) return {logps, entropy, logits};
  return {logps, entropy, grad};
}

std::vector<Tensor> logits_pass_new(Args& a) {
  return logits_pass(a, false);
}
std::vector<Tensor> logits_pass_inplace(Args& a) {
  return logits_pass(a, true);
}

// Value helpers for the argument lists logits_loss builds.
Value tensor_value(const Tensor& t) {
  Value v;
  v.kind = Value::Kind::kTensor;
  v.tensor = t;
  return v;
}
Value scalar_value(Value::Kind kind, double x) {
  Value v;
  v.kind = kind;
  v.i = static_cast<int64_t>(x);
  v.f = x;
  return v;
}

// `t` (contiguous) viewed with the contiguous shape `sizes`: the same storage.
Tensor view_contiguous(const Tensor& t, const std::vector<int64_t>& sizes) {
  Tensor view = t;
  view.sizes = sizes;
  view.strides.assign(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) view.strides[d - 1] = view.strides[d] * sizes[d];
  return view;
}

// grpo_loss_from_logits and grpo_loss_from_logits_: plan/logits_loss.h's logits_loss over this device's pass and
// loss forward (the ops above and in ops_loss.cpp, called with the arguments the composition hands them), then the
// kept-entropy kernel (cuda/grpo_loss_from_logits.cu's CudaLogitsLoss::entropy).
std::vector<Tensor> logits_loss(Args& a, bool inplace) {
  const std::vector<Value>& v = a.values();
  // logits, ids, advantages, completion_mask, the loss options, then 6: the logit options, the bonus, compute_grad
  if (v.size() < 10) bad_args("grpo_loss_from_logits: too few arguments");
  const Tensor logits = v[0].tensor, advantages = v[2].tensor, mask = v[3].tensor;
  const bool ids_as_mask =
      v[1].tensor.sizes == mask.sizes && v[1].tensor.strides == std::vector<int64_t>{mask.size(1), 1};
  const Tensor ids = ids_as_mask ? view_contiguous(v[1].tensor, {v[1].tensor.numel()}) : v[1].tensor;  // [B, T] as [N]
  const auto option_begin = v.begin() + 4, option_end = v.end() - 6;
  const Value &temperature = v.end()[-6], &logit_scale = v.end()[-5], &logit_softcap = v.end()[-4];
  const Value &coef = v.end()[-3], &weights = v.end()[-2];
  const bool compute_grad = v.end()[-1].i != 0;
  const int64_t batch = mask.size(0), seq_len = mask.size(1);
  const DType acc = accumulate_type(logits.dtype);
  // The options as the loss plans read them: the loss type, the level and loss_scale.
  Args option_args("options", std::vector<Value>(option_begin, option_end));
  const LossPlan options = plan_loss_inputs(batch, seq_len, std::nullopt, acc, advantages, mask, option_args, false,
                                            false);  // fmt: skip
  const bool whole_rows =
      compute_grad && (options.params.sequence_level || options.params.loss_type == grpo_ext::LossType::kVESPO);
  const auto run_pass_op = [&](const Value& token_grad, double entropy_coef, const Value& entropy_weights, bool grad,
                               bool in_place) {
    std::vector<Value> args{tensor_value(logits),     tensor_value(ids),  scalar_value(Value::Kind::kInt, 0),
                            tensor_value(advantages), tensor_value(mask), token_grad};
    args.insert(args.end(), option_begin, option_end);
    args.insert(args.end(), {temperature, logit_scale, logit_softcap, scalar_value(Value::Kind::kFloat, entropy_coef),
                             entropy_weights, scalar_value(Value::Kind::kBool, grad)});
    Args pass_args(in_place ? "grpo_loss_from_logits_pass_" : "grpo_loss_from_logits_pass", args);
    return logits_pass(pass_args, in_place);
  };
  const Value none;
  const std::vector<Tensor> pass = whole_rows ? run_pass_op(none, 0.0, weights, false, false)
                                              : run_pass_op(none, coef.f, weights, compute_grad, inplace);
  const Tensor logps = pass[0], entropy = pass[1];
  Tensor grad = pass[2];
  std::vector<Value> loss_values{tensor_value(view_contiguous(logps, {batch, seq_len})), tensor_value(advantages),
                                 tensor_value(mask)};
  loss_values.insert(loss_values.end(), option_begin, option_end);
  loss_values.push_back(scalar_value(Value::Kind::kBool, whole_rows));
  Args loss_args("grpo_loss_forward", loss_values);
  const std::vector<Tensor> loss = op_table().at("grpo_loss_forward")(loss_args);
  if (whole_rows) {  // token_grad = grad_raw * grad_scale, as aten::mul computes it on the device
    const Tensor token_grad = empty({batch * seq_len}, acc);
    for (int64_t i = 0; i < batch * seq_len; ++i) {
      if (acc == DType::kFloat64) {
        token_grad.data_as<double>()[i] = loss[2].data_as<double>()[i] * loss[3].data_as<double>()[0];
      } else {
        token_grad.data_as<float>()[i] = loss[2].data_as<float>()[i] * loss[3].data_as<float>()[0];
      }
    }
    grad = run_pass_op(tensor_value(token_grad), coef.f, weights, true, inplace)[2];
  }
  grpo_ext::StridedMatrix weights_view;
  if (weights.kind == Value::Kind::kTensor) weights_view = matrix_view(weights.tensor, batch, seq_len, false);
  const double bonus_scale = coef.f == 0.0 ? 0.0 : coef.f * options.loss_scale;
  const Tensor mean = empty({}, acc);
  if (acc == DType::kFloat64) {
    grpo_ext::launch_kept_entropy_mean<double>(options.inputs, weights_view, entropy.data_as<double>(), bonus_scale,
                                               loss[0].data_as<double>(), mean.data_as<double>(), nullptr);
  } else {
    grpo_ext::launch_kept_entropy_mean<float>(options.inputs, weights_view, entropy.data_as<float>(), bonus_scale,
                                              loss[0].data_as<float>(), mean.data_as<float>(), nullptr);
  }
  if (inplace) return {loss[0], loss[1], mean, logps, entropy, logits};  // the written argument last
  if (compute_grad) grad = view_contiguous(grad, logits.sizes);          // [N, V] as the logits' [B, T, V]
  return {loss[0], loss[1], mean, grad, logps, entropy};
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
