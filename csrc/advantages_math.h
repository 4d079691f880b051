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

// Overflow of the group statistics. The sum of a group's rewards, their squared deviations and a difference such as
// 3e38 - (-3e38) overflow float32 although every reward is finite. A group (or the batch) whose largest magnitude M
// exceeds 2^kScaleAboveExponent is therefore worked on in units of 2^e, e = floor(log2 M): every value times 2^-e
// (below 2 in magnitude, below 4 where e is capped), its mean, std and advantages computed there, the mean and std
// multiplied back by 2^e, and eps divided by it. A power of two scales exactly (short of the subnormals), and every
// +, -, *, /, sqrt commutes with it, so these are the unscaled operations' results wherever those do not overflow;
// below the threshold nothing is scaled at all, and the bits of ordinary rewards are the same as without scaling.
// Unscaled, |values| <= 2^40 keep the squared deviations <= 2^82 and their sum below float32's 2^128 for up to
// 2^45 members.
constexpr int kScaleAboveExponent = 40;

// The e >= 0 with max_abs * 2^-e in [1, 2), capped so that 2^-e stays a normal number (then max_abs * 2^-e < 4).
template <typename T>
GRPO_HD int magnitude_exponent(T max_abs) {
  using std::ilogb;
  constexpr int kCap = sizeof(T) == 4 ? 126 : 1022;
  if (!(max_abs >= T(1))) return 0;
  const int e = ilogb(max_abs);
  return e < kCap ? e : kCap;
}

// The exponent a set of values whose largest finite magnitude is max_abs is scaled by: 0 up to 2^40 (see above).
template <typename T>
GRPO_HD int scale_exponent(T max_abs) {
  return max_abs > T(int64_t(1) << kScaleAboveExponent) ? magnitude_exponent(max_abs) : 0;
}

// x * 2^e, exact short of overflow (+-inf) and the subnormals (one rounding); x itself when e is 0.
template <typename T>
GRPO_HD T times_pow2(T x, int e) {
  using std::ldexp;
  return e == 0 ? x : ldexp(x, e);
}

// Multiplication by 2^e as two normal factors (|e| up to twice T's largest exponent, the sum of two exponents
// above): exact short of overflow and the subnormals; by 1 and 1, so x bit for bit, when e is 0. No ldexp call per
// element in the kernels' loops.
template <typename T>
struct Pow2 {
  T hi = T(1), lo = T(1);
  GRPO_HD explicit Pow2(int e = 0) {
    if (e != 0) {
      hi = times_pow2(T(1), e / 2);
      lo = times_pow2(T(1), e - e / 2);
    }
  }
  GRPO_HD T operator()(T x) const { return x * hi * lo; }
};

// The largest magnitude of a scored value so far (NaN and +-inf are not scored).
template <typename T>
GRPO_HD T max_scored_abs(T running_max, T v) {
  using std::fabs;
  return is_scored(v) && fabs(v) > running_max ? fabs(v) : running_max;
}

// centered / denominator, but 0 where centered is 0: eps * 2^-e can underflow to 0 (or flush to 0), and then a group
// with std 0 would give 0 / 0. Elsewhere the same bits as the plain division.
template <typename T>
GRPO_HD T scaled_ratio(T centered, T denominator) {
  return centered == T(0) ? T(0) : centered / denominator;
}

// How a group's values are scaled: its combined rewards R are stored as R * 2^-exponent, and eps, which is added to
// a std, as eps * 2^-exponent; to_rewards multiplies by 2^exponent, back to R's units.
template <typename T>
struct GroupScale {
  int exponent = 0;
  T eps = T(0);
  Pow2<T> to_rewards;
};

template <typename T>
GRPO_HD GroupScale<T> group_scale(int exponent, double eps) {
  return {exponent, times_pow2(T(eps), -exponent), Pow2<T>(exponent)};
}

// R_i for "sum_then_normalize": the weighted sum of the scored rewards, NaN when none is scored; each reward times
// `scale` (a power of two: 1, or 2^-e when the unscaled sum overflows, see combined_overflow). The sum is +-inf,
// never NaN, when it overflows.
template <typename T>
GRPO_HD T combine_rewards(const StridedMatrix& rewards, const StridedMatrix& weights, int64_t row, int64_t k,
                          T scale = T(1)) {
  T total = T(0);
  bool any = false;
  for (int64_t j = 0; j < k; ++j) {
    const T r = rewards.load<T>(row, j);
    if (!is_scored(r)) continue;
    total += (weights.present() ? weights.load<T>(0, j) : T(1)) * (r * scale);
    any = true;
  }
  return any ? total : T(NAN);
}

// Whether a combined reward overflowed: +-inf (an unscored row is NaN).
template <typename T>
GRPO_HD bool combined_overflow(T combined) {
  return combined == combined && !is_scored(combined);
}

// The largest magnitude of a row's scored rewards, over its K columns.
template <typename T>
GRPO_HD T row_max_scored_abs(const StridedMatrix& rewards, int64_t row, int64_t k) {
  T m = T(0);
  for (int64_t j = 0; j < k; ++j) m = max_scored_abs(m, rewards.load<T>(row, j));
  return m;
}

// A_i from the combined reward, its baseline and the scale (docs/math.md section 1), all three in the group's units
// (`s`: R * 2^-s.exponent; eps likewise). `baseline_valid` is false for a leave-one-out row with no other scored
// member; `singleton`: the row is alone in its group. Without a scale the advantage is in R's units again.
template <typename T>
GRPO_HD T advantage_from(T reward, T baseline, bool baseline_valid, T sigma, bool singleton, const AdvantageParams& p,
                         const GroupScale<T>& s) {
  if (!is_scored(reward)) return T(0);
  if (p.verl_singletons && singleton) {  // verl: mean 0, std 1, so A = R / (1 + eps), or R unscaled
    if (p.scale == ScaleRewards::kNone) return s.to_rewards(reward);
    if (p.scale == ScaleRewards::kGroup) return s.to_rewards(reward / (T(1) + T(p.eps)));
    return scaled_ratio(reward, sigma + s.eps);
  }
  if (!baseline_valid) return T(0);
  const T centered = reward - baseline;
  return p.scale == ScaleRewards::kNone ? s.to_rewards(centered) : scaled_ratio(centered, sigma + s.eps);
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
