// CUDA binding of process_advantages: validate, allocate, launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../plan/process_advantages.h"
#include "process_advantages.cuh"

namespace grpo_ext {
namespace {

at::Tensor process_advantages_cuda(GRPO_PROCESS_ADVANTAGES_PARAMS) {
  TORCH_CHECK(step_rewards.is_cuda(), "step_rewards must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(step_rewards.device());
  ProcessAdvantagesPlan plan = plan_process_advantages(GRPO_PROCESS_ADVANTAGES_ARGS);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (plan.advantages.scalar_type() == at::kDouble) {
    launch_process_advantages<double>(plan.rewards, plan.step_end, plan.batch, plan.num_steps, plan.group_size,
                                      plan.seq_len, plan.eps, plan.std_ddof, plan.advantages.data_ptr<double>(),
                                      stream);
  } else {
    launch_process_advantages<float>(plan.rewards, plan.step_end, plan.batch, plan.num_steps, plan.group_size,
                                     plan.seq_len, float(plan.eps), plan.std_ddof, plan.advantages.data_ptr<float>(),
                                     stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return plan.advantages;
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("process_advantages", &process_advantages_cuda);
}

}  // namespace grpo_ext
