// CPU kernel of process_advantages: groups in parallel, each group in a fixed order.

#include <algorithm>

#include "../plan/process_advantages.h"

namespace grpo_ext {
namespace {

template <typename T>
void process_advantages_cpu_impl(ProcessAdvantagesPlan& plan) {
  const int64_t g_size = plan.group_size, steps = plan.num_steps, seq_len = plan.seq_len;
  T* out = plan.advantages.mutable_data_ptr<T>();
  const int64_t num_groups = plan.batch / g_size;
  auto valid = [&](int64_t row, int64_t j, T* reward) {
    const T r = plan.rewards.load<T>(row, j);
    *reward = r;
    return is_scored(r) && plan.step_end.load<int64_t>(row, j) >= 0;
  };
  torch::stable::parallel_for(0, num_groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      // The group's statistics in units of 2^e (advantages_math.h: e = 0 up to 2^40), so that they cannot overflow.
      T max_abs = T(0), r;
      for (int64_t row = g * g_size; row < (g + 1) * g_size; ++row)
        for (int64_t j = 0; j < steps; ++j)
          if (valid(row, j, &r)) max_abs = max_scored_abs(max_abs, r);
      const GroupScale<T> s = group_scale<T>(scale_exponent(max_abs), plan.eps);
      const T unit = times_pow2(T(1), -s.exponent);
      T sum = T(0), count = T(0);
      for (int64_t row = g * g_size; row < (g + 1) * g_size; ++row)
        for (int64_t j = 0; j < steps; ++j)
          if (valid(row, j, &r)) {
            sum += r * unit;
            count += T(1);
          }
      const T mu = safe_mean(sum, count);
      T sum_sq = T(0);
      for (int64_t row = g * g_size; row < (g + 1) * g_size; ++row)
        for (int64_t j = 0; j < steps; ++j)
          if (valid(row, j, &r)) sum_sq += (r * unit - mu) * (r * unit - mu);
      const T denom = std_from_sum_sq(sum_sq, count, plan.std_ddof) + s.eps;
      for (int64_t row = g * g_size; row < (g + 1) * g_size; ++row) {
        T* out_row = out + row * seq_len;
        for (int64_t t = 0; t < seq_len; ++t) out_row[t] = T(0);
        // A[i,t] = sum of rt[i,j] over steps ending at or after t: add each step to the prefix it covers.
        for (int64_t j = 0; j < steps; ++j) {
          if (!valid(row, j, &r)) continue;
          const int64_t last = std::min<int64_t>(plan.step_end.load<int64_t>(row, j), seq_len - 1);
          const T rt = scaled_ratio(r * unit - mu, denom);
          for (int64_t t = 0; t <= last; ++t) out_row[t] += rt;
        }
      }
    }
  });
}

Tensor process_advantages_cpu(GRPO_PROCESS_ADVANTAGES_PARAMS) {
  ProcessAdvantagesPlan plan = plan_process_advantages(GRPO_PROCESS_ADVANTAGES_ARGS);
  if (plan.advantages.scalar_type() == ScalarType::Double) {
    process_advantages_cpu_impl<double>(plan);
  } else {
    process_advantages_cpu_impl<float>(plan);
  }
  return plan.advantages;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("process_advantages", TORCH_BOX(&process_advantages_cpu));
}

}  // namespace grpo_ext
