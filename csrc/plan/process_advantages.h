// Host planning of process_advantages (docs/math.md section 1, process supervision): checks and output allocation.
#pragma once

#include "../advantages_math.h"
#include "checks.h"

namespace grpo_ext {

#define GRPO_PROCESS_ADVANTAGES_PARAMS \
  const Tensor &step_rewards, const Tensor &step_end, int64_t group_size, int64_t seq_len, double eps, int64_t std_ddof
#define GRPO_PROCESS_ADVANTAGES_ARGS step_rewards, step_end, group_size, seq_len, eps, std_ddof

struct ProcessAdvantagesPlan {
  StridedMatrix rewards, step_end;
  int64_t batch = 0, num_steps = 0, group_size = 1, seq_len = 0, std_ddof = 1;
  double eps = 1e-4;
  Tensor advantages;
};

inline ProcessAdvantagesPlan plan_process_advantages(GRPO_PROCESS_ADVANTAGES_PARAMS) {
  check_float(step_rewards, "step_rewards");
  GRPO_CHECK(step_rewards.dim() == 2, "step_rewards must have shape [B, S], got ", shape(step_rewards));
  GRPO_CHECK(step_end.scalar_type() == ScalarType::Long || step_end.scalar_type() == ScalarType::Int,
             "step_end must be an int64 (or int32) tensor, got ", step_end.scalar_type());
  GRPO_CHECK(same_shape(step_end, step_rewards), "step_end must have the shape of step_rewards ", shape(step_rewards),
             ", got ", shape(step_end));
  check_same_device(step_end, step_rewards, "step_end", "step_rewards");
  GRPO_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  GRPO_CHECK(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
  GRPO_CHECK(std_ddof >= 0, "std_ddof must be >= 0, got ", std_ddof);
  GRPO_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  ProcessAdvantagesPlan plan;
  plan.batch = step_rewards.size(0);
  GRPO_CHECK(plan.batch % group_size == 0, "step_rewards.shape[0]=", plan.batch,
             " is not divisible by group_size=", group_size);
  plan.num_steps = step_rewards.size(1);
  plan.group_size = group_size;
  plan.seq_len = seq_len;
  plan.std_ddof = std_ddof;
  plan.eps = eps;
  plan.rewards = matrix_view(step_rewards, plan.batch, plan.num_steps, "step_rewards", false);
  plan.step_end = matrix_view(step_end, plan.batch, plan.num_steps, "step_end", false);
  plan.advantages = new_empty(step_rewards, {plan.batch, seq_len}, accumulate_type(step_rewards.scalar_type()));
  return plan;
}

}  // namespace grpo_ext
