// Host planning of group_advantages (docs/math.md section 1): checks, option parsing, output allocation; the CPU
// and CUDA bindings run the plan.
#pragma once

#include <optional>
#include <tuple>

#include "../advantages_math.h"
#include "checks.h"

namespace grpo_ext {

inline ScaleRewards parse_scale_rewards(std::string_view s) {
  return parse_choice("scale_rewards", s, kScaleRewardsChoices);
}

inline Baseline parse_baseline(std::string_view s) {
  return parse_choice("baseline", s, kBaselineChoices);
}

inline Aggregation parse_aggregation(std::string_view s) {
  return parse_choice("multi_objective_aggregation", s, kAggregationChoices);
}

#define GRPO_GROUP_ADVANTAGES_PARAMS                                                                           \
  const Tensor &rewards, const std::optional<Tensor>&reward_weights, int64_t group_size,                       \
      std::string_view scale_rewards, std::string_view baseline, std::string_view multi_objective_aggregation, \
      double eps, int64_t std_ddof, std::string_view singleton_groups, const std::optional<Tensor>&group_ids,  \
      int64_t num_groups
#define GRPO_GROUP_ADVANTAGES_ARGS                                                                          \
  rewards, reward_weights, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof, \
      singleton_groups, group_ids, num_groups

using GroupAdvantagesResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

struct GroupAdvantagesPlan {
  AdvantageParams params;
  StridedMatrix rewards, weights;
  int64_t batch = 0, num_groups = 0;
  bool indexed = false;  // groups given by group_ids (int64 [B]) rather than runs of group_size rows
  Tensor group_ids;
  Tensor advantages, group_mean, group_std, zero_std;
  GroupAdvantagesResult result() const { return {advantages, group_mean, group_std, zero_std}; }
};

inline GroupAdvantagesPlan plan_group_advantages(GRPO_GROUP_ADVANTAGES_PARAMS) {
  check_float(rewards, "rewards");
  GRPO_CHECK(rewards.dim() == 1 || rewards.dim() == 2, "rewards must have shape [B] or [B, K], got ", shape(rewards));
  GRPO_CHECK(std_ddof >= 0, "std_ddof must be >= 0, got ", std_ddof);
  GRPO_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  const int64_t batch = rewards.size(0);
  GroupAdvantagesPlan plan;
  plan.batch = batch;
  if (group_ids.has_value()) {
    const Tensor& ids = *group_ids;
    GRPO_CHECK(ids.scalar_type() == ScalarType::Long, "group_ids must be an int64 tensor, got ", ids.scalar_type());
    GRPO_CHECK(ids.dim() == 1 && ids.size(0) == batch, "group_ids must have shape [", batch, "], got ", shape(ids));
    check_same_device(ids, rewards, "group_ids", "rewards");
    GRPO_CHECK(num_groups >= 0, "num_groups must be >= 0, got ", num_groups);
    GRPO_CHECK(batch < (int64_t(1) << 30) && num_groups < (int64_t(1) << 30),
               "group_ids: at most 2^30 rows and groups, got B=", batch, ", num_groups=", num_groups);
    if (ids.is_cpu() && batch > 0) {  // on CUDA this would sync the host: the kernel asserts instead
      const StridedMatrix id_view = matrix_view(ids, batch, 1, "group_ids", true);
      int64_t low = id_view.load<int64_t>(0, 0), high = low;
      for (int64_t i = 1; i < batch; ++i) {
        const int64_t id = id_view.load<int64_t>(i, 0);
        low = id < low ? id : low;
        high = id > high ? id : high;
      }
      GRPO_CHECK(low >= 0, "group_ids must be >= 0, got ", low);
      GRPO_CHECK(high < num_groups, "group_ids must be < num_groups=", num_groups, ", got ", high);
    }
    plan.indexed = true;
    plan.group_ids = ids;
    plan.num_groups = num_groups;
    group_size = 1;  // unused: each group's own size decides (a singleton is a group of one row)
  } else {
    GRPO_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
    GRPO_CHECK(batch % group_size == 0, "rewards.shape[0]=", batch, " is not divisible by group_size=", group_size);
    plan.num_groups = batch / group_size;
  }
  const int64_t k = rewards.dim() == 2 ? rewards.size(1) : 1;
  GRPO_CHECK(k >= 1, "rewards must have at least one column, got shape ", shape(rewards));
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
    const Tensor& w = *reward_weights;
    check_float(w, "reward_weights");
    check_same_device(w, rewards, "reward_weights", "rewards");
    GRPO_CHECK(w.dim() == 1 && w.size(0) == k, "reward_weights must have K=", k, " entries, got shape ", shape(w));
    plan.weights.data = w.data_ptr();
    plan.weights.dtype = dtype_tag(w.scalar_type(), "reward_weights");
    plan.weights.row_stride = 0;
    plan.weights.col_stride = w.stride(0);
  }
  const ScalarType acc = accumulate_type(rewards.scalar_type());
  plan.advantages = new_empty(rewards, {batch}, acc);
  plan.group_mean = new_empty(rewards, {plan.num_groups}, acc);
  plan.group_std = new_empty(rewards, {plan.num_groups}, acc);
  plan.zero_std = new_empty(rewards, {plan.num_groups}, ScalarType::Bool);
  return plan;
}

}  // namespace grpo_ext
