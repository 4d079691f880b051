// selective_log_softmax and the fused logits pass on the emulated device: plan/selective_log_softmax.h,
// plan/grpo_loss_from_logits.h, cuda/selective_log_softmax.cu and cuda/grpo_loss_from_logits.cu without torch.
#include <cstdlib>

#include "cuda/grpo_loss_from_logits.cuh"
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

}  // namespace
}  // namespace cuda_emu
