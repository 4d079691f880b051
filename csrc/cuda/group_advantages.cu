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
  Tensor workspace;  // the group lists of phase 0 (group_advantages.cuh), only with group_ids
  if (plan.indexed) {
    workspace = new_empty(rewards, {group_rows_workspace_size(plan.batch, plan.num_groups)}, ScalarType::Int);
  }
  int* ws = plan.indexed ? workspace.mutable_data_ptr<int>() : nullptr;
  if (plan.advantages.scalar_type() == ScalarType::Double) {
    launch_group_advantages<double>(
        plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride, plan.num_groups, ws,
        plan.advantages.mutable_data_ptr<double>(), plan.group_mean.mutable_data_ptr<double>(),
        plan.group_std.mutable_data_ptr<double>(), plan.zero_std.mutable_data_ptr<bool>(), stream);
  } else {
    launch_group_advantages<float>(plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride, plan.num_groups,
                                   ws, plan.advantages.mutable_data_ptr<float>(),
                                   plan.group_mean.mutable_data_ptr<float>(), plan.group_std.mutable_data_ptr<float>(),
                                   plan.zero_std.mutable_data_ptr<bool>(), stream);
  }
  check_launch();
  return plan.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("group_advantages", TORCH_BOX(&group_advantages_cuda));
}

}  // namespace grpo_ext
