// Group statistics of docs/math.md section 1 (group_advantages) and the process-supervision advantages, written once
// for the CPU and CUDA kernels. NaN marks an unscored reward (+-inf too); no NaN ever leaves these functions.
#pragma once

#include "common.h"

namespace grpo_ext {

struct AdvantageParams {
  int64_t group_size = 1;
  int64_t num_rewards = 1;  // K
  ScaleRewards scale = ScaleRewards::kGroup;
  Baseline baseline = Baseline::kMean;
  Aggregation aggregation = Aggregation::kSumThenNormalize;
  double eps = 1e-4;
  int64_t std_ddof = 1;
  bool verl_singletons = false;  // singleton_groups="verl": a group of one row has mean 0 and std 1 (section 1)
};

// Groups whose std is at most this are zero_std (all rewards equal).
constexpr double kZeroStdTolerance = 1e-8;

// Whether a reward (or a combined reward R) counts: a finite value. NaN means "not scored", and +-inf is treated
// alike (docs/math.md section 1), so that no NaN leaves the op. r - r is 0 exactly for a finite r.
template <typename T>
GRPO_HD bool is_scored(T r) {
  return r - r == T(0);
}

// NaN-aware std from a sum of squared deviations: 0 when fewer than ddof + 1 members are scored.
template <typename T>
GRPO_HD T std_from_sum_sq(T sum_sq_dev, T count, int64_t ddof) {
  using std::sqrt;
  return count > T(ddof) ? sqrt(sum_sq_dev / (count - T(ddof))) : T(0);
}

template <typename T>
GRPO_HD T safe_mean(T sum, T count) {
  return count > T(0) ? sum / count : T(0);
}

// R_i for "sum_then_normalize": the weighted sum of the scored rewards, NaN when none is scored.
template <typename T>
GRPO_HD T combine_rewards(const StridedMatrix& rewards, const StridedMatrix& weights, int64_t row, int64_t k) {
  T total = T(0);
  bool any = false;
  for (int64_t j = 0; j < k; ++j) {
    const T r = rewards.load<T>(row, j);
    if (!is_scored(r)) continue;
    total += (weights.present() ? weights.load<T>(0, j) : T(1)) * r;
    any = true;
  }
  return any ? total : T(NAN);
}

// A_i from the combined reward, its baseline and the scale (docs/math.md section 1). `baseline_valid` is false for a
// leave-one-out row with no other scored member; `singleton`: the row is alone in its group.
template <typename T>
GRPO_HD T advantage_from(T reward, T baseline, bool baseline_valid, T sigma, bool singleton, const AdvantageParams& p) {
  if (!is_scored(reward)) return T(0);
  if (p.verl_singletons && singleton) {  // verl: mean 0, std 1, so A = R / (1 + eps), or R unscaled
    return p.scale == ScaleRewards::kNone ? reward
                                          : reward / ((p.scale == ScaleRewards::kGroup ? T(1) : sigma) + T(p.eps));
  }
  if (!baseline_valid) return T(0);
  const T centered = reward - baseline;
  return p.scale == ScaleRewards::kNone ? centered : centered / (sigma + T(p.eps));
}

// Baseline of one member given its group's scored sum and count.
template <typename T>
GRPO_HD T baseline_for(T reward, T group_sum, T group_count, const AdvantageParams& p, bool* valid) {
  if (p.baseline == Baseline::kMean) {
    *valid = true;
    return safe_mean(group_sum, group_count);
  }
  const T others = group_count - T(1);
  *valid = is_scored(reward) && others > T(0);
  return *valid ? (group_sum - reward) / others : T(0);
}

}  // namespace grpo_ext
