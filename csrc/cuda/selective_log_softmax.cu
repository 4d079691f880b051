// CUDA binding of selective_log_softmax: validate, allocate, pick the dtypes, launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../plan/selective_log_softmax.h"
#include "selective_log_softmax.cuh"

namespace grpo_ext {
namespace {

SelectiveLogSoftmaxResult selective_log_softmax_forward_cuda(const at::Tensor& logits, const at::Tensor& ids,
                                                             double temperature, double logit_scale,
                                                             double logit_softcap, bool return_entropy) {
  TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(logits.device());
  SelectiveLogSoftmaxPlan plan =
      plan_selective_log_softmax(logits, ids, temperature, logit_scale, logit_softcap, return_entropy);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (plan.logps.scalar_type() == at::kDouble) {
    launch_selective_log_softmax_forward<double>(
        plan.logits, plan.ids, plan.rows, plan.vocab, plan.logit.transform<double>(), plan.logps.data_ptr<double>(),
        return_entropy ? plan.entropy.data_ptr<double>() : nullptr, plan.row_stats.data_ptr<double>(), stream);
  } else {
    launch_selective_log_softmax_forward<float>(
        plan.logits, plan.ids, plan.rows, plan.vocab, plan.logit.transform<float>(), plan.logps.data_ptr<float>(),
        return_entropy ? plan.entropy.data_ptr<float>() : nullptr, plan.row_stats.data_ptr<float>(), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {plan.logps, plan.entropy, plan.row_stats};
}

at::Tensor selective_log_softmax_backward_cuda(const at::Tensor& grad_logps,
                                               const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                                               const at::Tensor& ids, const at::Tensor& row_stats, double temperature,
                                               double logit_scale, double logit_softcap) {
  const LogitOptions logit = check_selective_log_softmax_backward(grad_logps, grad_entropy, logits, ids, row_stats,
                                                                  temperature, logit_scale, logit_softcap);
  TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const StridedMatrix x = matrix_view(logits, rows, vocab, "logits", false);
  const StridedMatrix id = matrix_view(ids, rows, 1, "ids", true);
  const StridedMatrix gl = matrix_view(grad_logps, rows, 1, "grad_logps", true);
  StridedMatrix gh;
  if (grad_entropy.has_value()) gh = matrix_view(*grad_entropy, rows, 1, "grad_entropy", true);
  at::Tensor grad_logits = at::empty({rows, vocab}, logits.options());
  const LogitTransform<float> f = logit.transform<float>();
  switch (logits.scalar_type()) {
    case at::kDouble:
      launch_selective_log_softmax_backward<double, double>(x, id, gl, gh, row_stats.data_ptr<double>(), rows, vocab,
                                                            logit.transform<double>(), grad_logits.data_ptr<double>(),
                                                            stream);
      break;
    case at::kFloat:
      launch_selective_log_softmax_backward<float, float>(x, id, gl, gh, row_stats.data_ptr<float>(), rows, vocab, f,
                                                          grad_logits.data_ptr<float>(), stream);
      break;
    case at::kBFloat16:
      launch_selective_log_softmax_backward<float, __nv_bfloat16>(
          x, id, gl, gh, row_stats.data_ptr<float>(), rows, vocab, f,
          reinterpret_cast<__nv_bfloat16*>(grad_logits.data_ptr<at::BFloat16>()), stream);
      break;
    default:
      launch_selective_log_softmax_backward<float, __half>(x, id, gl, gh, row_stats.data_ptr<float>(), rows, vocab, f,
                                                           reinterpret_cast<__half*>(grad_logits.data_ptr<at::Half>()),
                                                           stream);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("selective_log_softmax_forward", &selective_log_softmax_forward_cuda);
  m.impl("selective_log_softmax_backward", &selective_log_softmax_backward_cuda);
}

}  // namespace grpo_ext
