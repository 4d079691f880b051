// Host planning of group_advantages (docs/math.md section 1): checks, option parsing, output allocation; the CPU
// and CUDA bindings run the plan.
#pragma once

#include <tuple>

#include "../advantages_math.h"
#include "checks.h"

namespace grpo_ext {

inline ScaleRewards parse_scale_rewards(c10::string_view s) {
  return parse_choice("scale_rewards", s, kScaleRewardsChoices);
}

inline Baseline parse_baseline(c10::string_view s) {
  return parse_choice("baseline", s, kBaselineChoices);
}

inline Aggregation parse_aggregation(c10::string_view s) {
  return parse_choice("multi_objective_aggregation", s, kAggregationChoices);
}

#define GRPO_GROUP_ADVANTAGES_PARAMS                                                                           \
  const at::Tensor &rewards, const std::optional<at::Tensor>&reward_weights, int64_t group_size,               \
      c10::string_view scale_rewards, c10::string_view baseline, c10::string_view multi_objective_aggregation, \
      double eps, int64_t std_ddof, c10::string_view singleton_groups
#define GRPO_GROUP_ADVANTAGES_ARGS                                                                          \
  rewards, reward_weights, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof, \
      singleton_groups

using GroupAdvantagesResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct GroupAdvantagesPlan {
  AdvantageParams params;
  StridedMatrix rewards, weights;
  int64_t batch = 0, num_groups = 0;
  at::Tensor advantages, group_mean, group_std, zero_std;
  GroupAdvantagesResult result() const { return {advantages, group_mean, group_std, zero_std}; }
};

inline GroupAdvantagesPlan plan_group_advantages(GRPO_GROUP_ADVANTAGES_PARAMS) {
  check_float(rewards, "rewards");
  TORCH_CHECK(rewards.dim() == 1 || rewards.dim() == 2, "rewards must have shape [B] or [B, K], got ", rewards.sizes());
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  TORCH_CHECK(std_ddof >= 0, "std_ddof must be >= 0, got ", std_ddof);
  TORCH_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  const int64_t batch = rewards.size(0);
  TORCH_CHECK(batch % group_size == 0, "rewards.shape[0]=", batch, " is not divisible by group_size=", group_size);
  GroupAdvantagesPlan plan;
  plan.batch = batch;
  plan.num_groups = batch / group_size;
  const int64_t k = rewards.dim() == 2 ? rewards.size(1) : 1;
  TORCH_CHECK(k >= 1, "rewards must have at least one column, got shape ", rewards.sizes());
  plan.params.group_size = group_size;
  plan.params.num_rewards = k;
  plan.params.scale = parse_scale_rewards(scale_rewards);
  plan.params.baseline = parse_baseline(baseline);
  plan.params.aggregation = parse_aggregation(multi_objective_aggregation);
  plan.params.eps = eps;
  plan.params.std_ddof = std_ddof;
  plan.params.verl_singletons = parse_choice("singleton_groups", singleton_groups, kSingletonGroupsChoices);
  plan.rewards.data = rewards.data_ptr();
  plan.rewards.dtype = dtype_tag(rewards.scalar_type(), "rewards");
  plan.rewards.row_stride = rewards.stride(0);
  plan.rewards.col_stride = rewards.dim() == 2 ? rewards.stride(1) : 0;
  if (reward_weights.has_value()) {
    const at::Tensor& w = *reward_weights;
    check_float(w, "reward_weights");
    check_same_device(w, rewards, "reward_weights", "rewards");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == k, "reward_weights must have K=", k, " entries, got shape ", w.sizes());
    plan.weights.data = w.data_ptr();
    plan.weights.dtype = dtype_tag(w.scalar_type(), "reward_weights");
    plan.weights.row_stride = 0;
    plan.weights.col_stride = w.stride(0);
  }
  const auto opts = rewards.options().dtype(accumulate_type(rewards.scalar_type()));
  plan.advantages = at::empty({batch}, opts);
  plan.group_mean = at::empty({plan.num_groups}, opts);
  plan.group_std = at::empty({plan.num_groups}, opts);
  plan.zero_std = at::empty({plan.num_groups}, opts.dtype(at::kBool));
  return plan;
}

}  // namespace grpo_ext
