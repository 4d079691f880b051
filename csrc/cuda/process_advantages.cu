// CUDA binding of process_advantages: validate, allocate, launch on the current stream.

#include "../plan/process_advantages.h"
#include "device.h"
#include "process_advantages.cuh"

namespace grpo_ext {
namespace {

Tensor process_advantages_cuda(GRPO_PROCESS_ADVANTAGES_PARAMS) {
  const CudaCall call(step_rewards, "step_rewards");
  ProcessAdvantagesPlan plan = plan_process_advantages(GRPO_PROCESS_ADVANTAGES_ARGS);
  const cudaStream_t stream = call.stream();
  if (plan.advantages.scalar_type() == ScalarType::Double) {
    launch_process_advantages<double>(plan.rewards, plan.step_end, plan.batch, plan.num_steps, plan.group_size,
                                      plan.seq_len, plan.eps, plan.std_ddof, plan.advantages.mutable_data_ptr<double>(),
                                      stream);
  } else {
    launch_process_advantages<float>(plan.rewards, plan.step_end, plan.batch, plan.num_steps, plan.group_size,
                                     plan.seq_len, float(plan.eps), plan.std_ddof,
                                     plan.advantages.mutable_data_ptr<float>(), stream);
  }
  check_launch();
  return plan.advantages;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("process_advantages", TORCH_BOX(&process_advantages_cuda));
}

}  // namespace grpo_ext
