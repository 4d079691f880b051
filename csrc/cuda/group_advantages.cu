// CUDA binding of group_advantages: validate, allocate, launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../plan/group_advantages.h"
#include "group_advantages.cuh"

namespace grpo_ext {
namespace {

GroupAdvantagesResult group_advantages_cuda(GRPO_GROUP_ADVANTAGES_PARAMS) {
  TORCH_CHECK(rewards.is_cuda(), "rewards must be a CUDA tensor for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(rewards.device());
  GroupAdvantagesPlan plan = plan_group_advantages(GRPO_GROUP_ADVANTAGES_ARGS);
  if (plan.batch == 0 && plan.num_groups == 0) return plan.result();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* ids = plan.indexed ? plan.group_ids.data_ptr<int64_t>() : nullptr;
  const int64_t id_stride = plan.indexed ? plan.group_ids.stride(0) : 0;
  at::Tensor workspace;  // the group lists of phase 0 (group_advantages.cuh), only with group_ids
  if (plan.indexed) {
    workspace = at::empty({group_rows_workspace_size(plan.batch, plan.num_groups)}, rewards.options().dtype(at::kInt));
  }
  int* ws = plan.indexed ? workspace.data_ptr<int>() : nullptr;
  if (plan.advantages.scalar_type() == at::kDouble) {
    launch_group_advantages<double>(plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride,
                                    plan.num_groups, ws, plan.advantages.data_ptr<double>(),
                                    plan.group_mean.data_ptr<double>(), plan.group_std.data_ptr<double>(),
                                    plan.zero_std.data_ptr<bool>(), stream);
  } else {
    launch_group_advantages<float>(plan.params, plan.rewards, plan.weights, plan.batch, ids, id_stride, plan.num_groups,
                                   ws, plan.advantages.data_ptr<float>(), plan.group_mean.data_ptr<float>(),
                                   plan.group_std.data_ptr<float>(), plan.zero_std.data_ptr<bool>(), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return plan.result();
}

}  // namespace

TORCH_LIBRARY_IMPL(grpo_ext, CUDA, m) {
  m.impl("group_advantages", &group_advantages_cuda);
}

}  // namespace grpo_ext
