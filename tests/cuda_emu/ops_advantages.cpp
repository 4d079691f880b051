// group_advantages and process_advantages on the emulated device: plan/group_advantages.h and
// plan/process_advantages.h, then cuda/group_advantages.cu and cuda/process_advantages.cu, without torch.
#include "cuda/group_advantages.cuh"
#include "cuda/process_advantages.cuh"
#include "driver.h"
#include "option_choices.h"

namespace cuda_emu {
namespace {

using grpo_ext::Aggregation, grpo_ext::Baseline, grpo_ext::ScaleRewards;

// The option strings the bindings accept (csrc/option_choices.h); anything else is a bad request.
template <typename E, size_t N>
E parse(const std::string& value, const grpo_ext::Choice<E> (&choices)[N]) {
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
  }
  bad_args("unknown option value " + value);
}

std::vector<Tensor> group_advantages(Args& a) {
  const Tensor rewards = a.tensor();
  const std::optional<Tensor> weights = a.optional_tensor();
  grpo_ext::AdvantageParams p;
  p.group_size = a.integer();
  p.scale = parse(a.string(), grpo_ext::kScaleRewardsChoices);
  p.baseline = parse(a.string(), grpo_ext::kBaselineChoices);
  p.aggregation = parse(a.string(), grpo_ext::kAggregationChoices);
  p.eps = a.number();
  p.std_ddof = a.integer();
  p.verl_singletons = parse(a.string(), grpo_ext::kSingletonGroupsChoices);
  const std::optional<Tensor> group_ids = a.optional_tensor();
  int64_t num_groups = a.integer();
  a.done();
  const int64_t batch = rewards.size(0);
  if (group_ids) {
    p.group_size = 1;
  } else {
    num_groups = batch / p.group_size;
  }
  p.num_rewards = rewards.dim() == 2 ? rewards.size(1) : 1;
  grpo_ext::StridedMatrix r{rewards.data(), rewards.dtype, rewards.stride(0),
                            rewards.dim() == 2 ? rewards.stride(1) : 0};
  grpo_ext::StridedMatrix w;
  if (weights) w = {weights->data(), weights->dtype, 0, weights->stride(0)};
  const DType acc = accumulate_type(rewards.dtype);
  Tensor adv = empty({batch}, acc), mean = empty({num_groups}, acc), std = empty({num_groups}, acc);
  Tensor zero_std = empty({num_groups}, DType::kBool);
  if (batch == 0 && num_groups == 0) return {adv, mean, std, zero_std};
  const int64_t* ids = group_ids ? group_ids->data_as<int64_t>() : nullptr;
  const int64_t id_stride = group_ids ? group_ids->stride(0) : 0;
  const grpo_ext::GroupAdvantagesLaunch launch =
      grpo_ext::plan_group_advantages_launch(p, batch, num_groups, group_ids.has_value());
  Tensor workspace = empty({(launch.bytes + 7) / 8}, DType::kFloat64);
  if (acc == DType::kFloat64) {
    grpo_ext::launch_group_advantages<double>(p, r, w, batch, ids, id_stride, num_groups, launch, workspace.data(),
                                              adv.data_as<double>(), mean.data_as<double>(), std.data_as<double>(),
                                              zero_std.data_as<bool>(), nullptr);
  } else {
    grpo_ext::launch_group_advantages<float>(p, r, w, batch, ids, id_stride, num_groups, launch, workspace.data(),
                                             adv.data_as<float>(), mean.data_as<float>(), std.data_as<float>(),
                                             zero_std.data_as<bool>(), nullptr);
  }
  return {adv, mean, std, zero_std};
}

std::vector<Tensor> process_advantages(Args& a) {
  const Tensor rewards = a.tensor(), step_end = a.tensor();
  const int64_t group_size = a.integer(), seq_len = a.integer();
  const double eps = a.number();
  const int64_t std_ddof = a.integer();
  a.done();
  const int64_t batch = rewards.size(0), num_steps = rewards.size(1);
  const grpo_ext::StridedMatrix r = matrix_view(rewards, batch, num_steps, false);
  const grpo_ext::StridedMatrix e = matrix_view(step_end, batch, num_steps, false);
  Tensor out = empty({batch, seq_len}, accumulate_type(rewards.dtype));
  if (out.dtype == DType::kFloat64) {
    grpo_ext::launch_process_advantages<double>(r, e, batch, num_steps, group_size, seq_len, eps, std_ddof,
                                                out.data_as<double>(), nullptr);
  } else {
    grpo_ext::launch_process_advantages<float>(r, e, batch, num_steps, group_size, seq_len, float(eps), std_ddof,
                                               out.data_as<float>(), nullptr);
  }
  return {out};
}

// The launch plan of a group_advantages call (not an op of grpo_ext: the launcher's choices, for the tests and the
// kernel report): int64 [threads per block, lanes per group, tiles (the grid), workspace bytes].
std::vector<Tensor> group_advantages_launch_plan(Args& a) {
  grpo_ext::AdvantageParams p;
  const int64_t batch = a.integer(), num_groups = a.integer();
  p.group_size = a.integer();
  p.scale = parse(a.string(), grpo_ext::kScaleRewardsChoices);
  p.aggregation = parse(a.string(), grpo_ext::kAggregationChoices);
  const bool indexed = a.integer() != 0;
  a.done();
  const grpo_ext::GroupAdvantagesLaunch l = grpo_ext::plan_group_advantages_launch(p, batch, num_groups, indexed);
  Tensor out = empty({4}, DType::kInt64);
  int64_t* v = out.data_as<int64_t>();
  v[0] = l.threads;
  v[1] = l.team_width;
  v[2] = l.tiles;
  v[3] = l.bytes;
  return {out};
}

const RegisterOp kGroupAdvantages("group_advantages", group_advantages);
const RegisterOp kGroupAdvantagesLaunchPlan("group_advantages_launch_plan", group_advantages_launch_plan);
const RegisterOp kProcessAdvantages("process_advantages", process_advantages);

}  // namespace
}  // namespace cuda_emu
