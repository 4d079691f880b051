// CUDA binding of group_advantages: validate, allocate, launch on the current stream.

#include "../plan/group_advantages.h"
#include "device.h"
#include "group_advantages.cuh"

namespace grpo_ext {
namespace {

GroupAdvantagesResult group_advantages_cuda(GRPO_GROUP_ADVANTAGES_PARAMS) {
  const CudaCall call(rewards, "rewards");
  GroupAdvantagesPlan plan = plan_group_advantages(GRPO_GROUP_ADVANTAGES_ARGS);
  if (plan.batch == 0 && plan.num_groups == 0) return plan.result();
  const cudaStream_t stream = call.stream();
  const int64_t* ids = plan.indexed ? plan.group_ids.mutable_data_ptr<int64_t>() : nullptr;
  const int64_t id_stride = plan.indexed ? plan.group_ids.stride(0) : 0;
  const GroupAdvantagesLaunch launch =
      plan_group_advantages_launch(plan.params, plan.batch, plan.num_groups, plan.indexed);
  // Group lists, tile moments and counters (group_advantages.cuh); float64 elements keep it 8-byte aligned.
  const Tensor workspace = new_empty(rewards, {(launch.bytes + 7) / 8}, ScalarType::Double);
  void* ws = workspace.mutable_data_ptr();
  cudaError_t status;
  if (plan.advantages.scalar_type() == ScalarType::Double) {
    status = launch_group_advantages<double>(
        plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride, plan.num_groups, launch, ws,
        plan.advantages.mutable_data_ptr<double>(), plan.group_mean.mutable_data_ptr<double>(),
        plan.group_std.mutable_data_ptr<double>(), plan.zero_std.mutable_data_ptr<bool>(), stream);
  } else {
    status = launch_group_advantages<float>(
        plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride, plan.num_groups, launch, ws,
        plan.advantages.mutable_data_ptr<float>(), plan.group_mean.mutable_data_ptr<float>(),
        plan.group_std.mutable_data_ptr<float>(), plan.zero_std.mutable_data_ptr<bool>(), stream);
  }
  check_cuda_status(status, "group_advantages workspace memset");
  check_launch();
  return plan.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("group_advantages", TORCH_BOX(&group_advantages_cuda));
}

}  // namespace grpo_ext
