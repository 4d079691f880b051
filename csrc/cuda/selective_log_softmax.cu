// CUDA binding of selective_log_softmax: validate, allocate, pick the dtypes, launch on the current stream.

#include "../plan/selective_log_softmax.h"
#include "device.h"
#include "selective_log_softmax.cuh"

namespace grpo_ext {
namespace {

SelectiveLogSoftmaxResult selective_log_softmax_forward_cuda(const Tensor& logits, const Tensor& ids,
                                                             double temperature, double logit_scale,
                                                             double logit_softcap, bool return_entropy) {
  const CudaCall call(logits, "logits");
  SelectiveLogSoftmaxPlan plan =
      plan_selective_log_softmax(logits, ids, temperature, logit_scale, logit_softcap, return_entropy);
  const cudaStream_t stream = call.stream();
  if (plan.logps.scalar_type() == ScalarType::Double) {
    launch_selective_log_softmax_forward<double>(plan.logits, plan.ids, plan.rows, plan.vocab,
                                                 plan.logit.transform<double>(), plan.logps.mutable_data_ptr<double>(),
                                                 return_entropy ? plan.entropy.mutable_data_ptr<double>() : nullptr,
                                                 plan.row_stats.mutable_data_ptr<double>(), stream);
  } else {
    launch_selective_log_softmax_forward<float>(plan.logits, plan.ids, plan.rows, plan.vocab,
                                                plan.logit.transform<float>(), plan.logps.mutable_data_ptr<float>(),
                                                return_entropy ? plan.entropy.mutable_data_ptr<float>() : nullptr,
                                                plan.row_stats.mutable_data_ptr<float>(), stream);
  }
  check_launch();
  return {plan.logps, plan.entropy, plan.row_stats};
}

Tensor selective_log_softmax_backward_cuda(const Tensor& grad_logps, const std::optional<Tensor>& grad_entropy,
                                           const Tensor& logits, const Tensor& ids, const Tensor& row_stats,
                                           double temperature, double logit_scale, double logit_softcap) {
  const LogitOptions logit = check_selective_log_softmax_backward(grad_logps, grad_entropy, logits, ids, row_stats,
                                                                  temperature, logit_scale, logit_softcap);
  const CudaCall call(logits, "logits");
  const cudaStream_t stream = call.stream();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const StridedMatrix x = matrix_view(logits, rows, vocab, "logits", false);
  const StridedMatrix id = matrix_view(ids, rows, 1, "ids", true);
  const StridedMatrix gl = matrix_view(grad_logps, rows, 1, "grad_logps", true);
  StridedMatrix gh;
  if (grad_entropy.has_value()) gh = matrix_view(*grad_entropy, rows, 1, "grad_entropy", true);
  Tensor grad_logits = new_empty(logits, {rows, vocab}, logits.scalar_type());
  const LogitTransform<float> f = logit.transform<float>();
  switch (logits.scalar_type()) {
    case ScalarType::Double:
      launch_selective_log_softmax_backward<double, double>(x, id, gl, gh, row_stats.mutable_data_ptr<double>(), rows,
                                                            vocab, logit.transform<double>(),
                                                            grad_logits.mutable_data_ptr<double>(), stream);
      break;
    case ScalarType::Float:
      launch_selective_log_softmax_backward<float, float>(x, id, gl, gh, row_stats.mutable_data_ptr<float>(), rows,
                                                          vocab, f, grad_logits.mutable_data_ptr<float>(), stream);
      break;
    case ScalarType::BFloat16:
      launch_selective_log_softmax_backward<float, __nv_bfloat16>(
          x, id, gl, gh, row_stats.mutable_data_ptr<float>(), rows, vocab, f,
          reinterpret_cast<__nv_bfloat16*>(grad_logits.mutable_data_ptr<BFloat16>()), stream);
      break;
    default:
      launch_selective_log_softmax_backward<float, __half>(
          x, id, gl, gh, row_stats.mutable_data_ptr<float>(), rows, vocab, f,
          reinterpret_cast<__half*>(grad_logits.mutable_data_ptr<Half>()), stream);
      break;
  }
  check_launch();
  return grad_logits;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("selective_log_softmax_forward", TORCH_BOX(&selective_log_softmax_forward_cuda));
  m.impl("selective_log_softmax_backward", TORCH_BOX(&selective_log_softmax_backward_cuda));
}

}  // namespace grpo_ext
