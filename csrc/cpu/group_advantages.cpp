// CPU kernel of group_advantages: groups in parallel, each group in a fixed order (its rows in increasing order).

#include <algorithm>
#include <cmath>
#include <vector>

#include "../plan/group_advantages.h"

namespace grpo_ext {
namespace {

// Scales values[0..n) in place by 2^-e, e = scale_exponent of their largest scored magnitude (advantages_math.h: 0,
// and nothing changes, up to 2^40), so that their statistics cannot overflow. Returns e.
template <typename T>
int scale_down(T* values, int64_t n) {
  T max_abs = T(0);
  for (int64_t i = 0; i < n; ++i) max_abs = max_scored_abs(max_abs, values[i]);
  const int e = scale_exponent(max_abs);
  const T unit = times_pow2(T(1), -e);  // a normal number (e <= the cap of magnitude_exponent)
  for (int64_t i = 0; e != 0 && i < n; ++i) values[i] *= unit;
  return e;
}

// NaN-aware mean and std of values[0..n) (NaN or +-inf = unscored); the caller scales them first (scale_down).
template <typename T>
void nan_moments(const T* values, int64_t n, int64_t ddof, T* mean, T* std_out, T* count_out) {
  T sum = T(0), count = T(0);
  for (int64_t i = 0; i < n; ++i) {
    if (is_scored(values[i])) {
      sum += values[i];
      count += T(1);
    }
  }
  const T mu = safe_mean(sum, count);
  T sum_sq = T(0);
  for (int64_t i = 0; i < n; ++i) {
    if (is_scored(values[i])) sum_sq += (values[i] - mu) * (values[i] - mu);
  }
  *mean = mu;
  *std_out = std_from_sum_sq(sum_sq, count, ddof);
  *count_out = count;
}

// The rows of each group: group g is members[offsets[g] .. offsets[g + 1]), in increasing row order. Contiguous groups
// are runs of group_size rows; group_ids are placed by a stable counting sort.
void group_members(const GroupAdvantagesPlan& plan, std::vector<int64_t>& offsets, std::vector<int64_t>& members) {
  offsets.assign(static_cast<size_t>(plan.num_groups) + 1, 0);
  members.resize(static_cast<size_t>(plan.batch));
  if (!plan.indexed) {
    for (int64_t g = 0; g <= plan.num_groups; ++g) offsets[g] = g * plan.params.group_size;
    for (int64_t i = 0; i < plan.batch; ++i) members[i] = i;
    return;
  }
  const int64_t* ids = plan.group_ids.mutable_data_ptr<int64_t>();
  const int64_t id_stride = plan.group_ids.stride(0);
  for (int64_t i = 0; i < plan.batch; ++i) ++offsets[ids[i * id_stride] + 1];
  for (int64_t g = 0; g < plan.num_groups; ++g) offsets[g + 1] += offsets[g];
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < plan.batch; ++i) members[cursor[ids[i * id_stride]]++] = i;
}

template <typename T>
void group_advantages_cpu_impl(GroupAdvantagesPlan& plan) {
  const AdvantageParams& p = plan.params;
  const int64_t k = p.num_rewards;
  const bool gdpo = p.aggregation == Aggregation::kNormalizeThenSum;
  std::vector<int64_t> offsets, members;
  group_members(plan, offsets, members);
  // R in group order, group g at combined[offsets[g]], in units of 2^exponents[g] (advantages_math.h).
  std::vector<T> combined(static_cast<size_t>(plan.batch));
  std::vector<int> exponents(static_cast<size_t>(plan.num_groups));
  std::vector<T> scaled_std(static_cast<size_t>(plan.num_groups));  // each group's std of R in its units
  T* adv = plan.advantages.mutable_data_ptr<T>();
  T* g_mean = plan.group_mean.mutable_data_ptr<T>();
  T* g_std = plan.group_std.mutable_data_ptr<T>();
  bool* g_zero = plan.zero_std.mutable_data_ptr<bool>();

  // Phase 1: the combined reward R of every row and each group's own statistics of R.
  const int64_t rows_per_group = std::max<int64_t>(1, plan.batch / std::max<int64_t>(plan.num_groups, 1));
  const int64_t grain = std::max<int64_t>(1, 4096 / rows_per_group);  // small batches stay on one thread
  torch::stable::parallel_for(0, plan.num_groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> column;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t g_size = offsets[g + 1] - offsets[g];
      const int64_t* rows = members.data() + offsets[g];
      T* r_group = combined.data() + offsets[g];
      int exponent = 0;  // of R before scale_down below: only a weighted sum that overflows is scaled here
      if (gdpo) {        // z-score each reward function inside the group, then nansum with the weights
        // R starts NaN and turns 0 + ... at its first scored reward: an unscorable row stays NaN (docs/math.md 1).
        for (int64_t i = 0; i < g_size; ++i) r_group[i] = T(NAN);
        for (int64_t j = 0; j < k; ++j) {
          column.resize(static_cast<size_t>(g_size));
          for (int64_t i = 0; i < g_size; ++i) column[i] = plan.rewards.load<T>(rows[i], j);
          const GroupScale<T> s = group_scale<T>(scale_down(column.data(), g_size), p.eps);
          T mu, sigma, count;
          nan_moments(column.data(), g_size, p.std_ddof, &mu, &sigma, &count);
          const T w = plan.weights.present() ? plan.weights.load<T>(0, j) : T(1);
          for (int64_t i = 0; i < g_size; ++i) {
            if (is_scored(column[i])) {
              const T z = scaled_ratio(w * (column[i] - mu), sigma + s.eps);
              r_group[i] = (r_group[i] == r_group[i] ? r_group[i] : T(0)) + z;
            }
          }
        }
      } else if (k == 1 && !plan.weights.present()) {  // one reward function: R is the reward itself
        const StridedMatrix& r = plan.rewards;
        if (r.dtype == (sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64)) {
          const T* src = static_cast<const T*>(r.data);
          for (int64_t i = 0; i < g_size; ++i) r_group[i] = src[rows[i] * r.row_stride];
        } else {
          for (int64_t i = 0; i < g_size; ++i) r_group[i] = r.load<T>(rows[i], 0);
        }
      } else {
        bool overflow = false;
        for (int64_t i = 0; i < g_size; ++i) {
          r_group[i] = combine_rewards<T>(plan.rewards, plan.weights, rows[i], k);
          overflow |= combined_overflow(r_group[i]);
        }
        if (overflow) {  // a weighted sum beyond the dtype's range: sum the rewards in units of their magnitude
          T max_abs = T(0);
          for (int64_t i = 0; i < g_size; ++i)
            max_abs = std::max(max_abs, row_max_scored_abs<T>(plan.rewards, rows[i], k));
          exponent = magnitude_exponent(max_abs);
          const T scale = times_pow2(T(1), -exponent);
          for (int64_t i = 0; i < g_size; ++i) {
            r_group[i] = combine_rewards<T>(plan.rewards, plan.weights, rows[i], k, scale);
          }
        }
      }
      exponent += scale_down(r_group, g_size);
      exponents[g] = exponent;
      T mu, sigma, count;
      nan_moments(r_group, g_size, p.std_ddof, &mu, &sigma, &count);
      scaled_std[g] = sigma;
      g_mean[g] = times_pow2(mu, exponent);
      g_std[g] = times_pow2(sigma, exponent);  // +inf where the std is beyond the dtype's range (float32: 3.4e38)
      g_zero[g] = count >= T(2) && g_std[g] <= T(kZeroStdTolerance);
    }
  });

  // Phase 2: batch statistics when the scale (or GDPO's final z-score) is batch-wide; a fixed sequential order. In
  // units of 2^batch_exponent, the largest group's: each group's R brought to them (exact, or below its precision).
  T batch_mean = T(0), batch_std = T(0), batch_count = T(0);
  int batch_exponent = 0;
  if (gdpo || p.scale == ScaleRewards::kBatch) {
    for (int64_t g = 0; g < plan.num_groups; ++g) batch_exponent = std::max(batch_exponent, exponents[g]);
    if (batch_exponent == 0) {
      nan_moments(combined.data(), plan.batch, p.std_ddof, &batch_mean, &batch_std, &batch_count);
    } else {
      std::vector<T> in_batch_units(combined.size());
      for (int64_t g = 0; g < plan.num_groups; ++g) {
        const Pow2<T> to_batch(exponents[g] - batch_exponent);
        for (int64_t i = offsets[g]; i < offsets[g + 1]; ++i) in_batch_units[i] = to_batch(combined[i]);
      }
      nan_moments(in_batch_units.data(), plan.batch, p.std_ddof, &batch_mean, &batch_std, &batch_count);
    }
  }
  const GroupScale<T> batch_scale = group_scale<T>(batch_exponent, p.eps);

  // Phase 3: advantages.
  torch::stable::parallel_for(0, plan.num_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t g_size = offsets[g + 1] - offsets[g];
      const int64_t* rows = members.data() + offsets[g];
      const T* r_group = combined.data() + offsets[g];
      const int exponent = exponents[g];
      if (gdpo) {
        const Pow2<T> to_batch(exponent - batch_exponent);
        for (int64_t i = 0; i < g_size; ++i) {
          const T r = to_batch(r_group[i]);
          adv[rows[i]] = is_scored(r) ? scaled_ratio(r - batch_mean, batch_std + batch_scale.eps) : T(0);
        }
        continue;
      }
      T sum = T(0), count = T(0);
      for (int64_t i = 0; i < g_size; ++i) {
        if (is_scored(r_group[i])) {
          sum += r_group[i];
          count += T(1);
        }
      }
      // The std in the group's units: the batch's brought from the batch's units (+inf beyond the dtype's range).
      const T sigma =
          p.scale == ScaleRewards::kBatch ? times_pow2(batch_std, batch_exponent - exponent) : scaled_std[g];
      const GroupScale<T> s = group_scale<T>(exponent, p.eps);
      for (int64_t i = 0; i < g_size; ++i) {
        bool valid;
        const T b = baseline_for(r_group[i], sum, count, p, &valid);
        adv[rows[i]] = advantage_from(r_group[i], b, valid, sigma, g_size == 1, p, s);
      }
    }
  });
}

GroupAdvantagesResult group_advantages_cpu(GRPO_GROUP_ADVANTAGES_PARAMS) {
  GroupAdvantagesPlan plan = plan_group_advantages(GRPO_GROUP_ADVANTAGES_ARGS);
  if (plan.advantages.scalar_type() == ScalarType::Double) {
    group_advantages_cpu_impl<double>(plan);
  } else {
    group_advantages_cpu_impl<float>(plan);
  }
  return plan.result();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("group_advantages", TORCH_BOX(&group_advantages_cpu));
}

}  // namespace grpo_ext
