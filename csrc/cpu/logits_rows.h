// The logits ops' row loops (logits_rows.inc: the softmax max and sums, and the elementwise loops) compiled once per
// instruction set: baseline x86-64 (SSE2), AVX2 and AVX-512 (without FMA contraction), all giving the same bits;
// GRPO_CPU_ISA_CALL(isa, fn<...>(args)) calls the copy of cpu_isa(), and row_softmax is a row's statistics.
#pragma once

#include "../logit_transform.h"
#include "row_utils.h"

namespace grpo_ext {
namespace cpu {

namespace isa_baseline {
constexpr int kVectorBytes = 16;
#include "logits_rows.inc"
}  // namespace isa_baseline

#ifdef GRPO_EXT_X86_AVX2
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2")
constexpr int kVectorBytes = 32;
#include "logits_rows.inc"
#pragma GCC pop_options
}  // namespace isa_avx2
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#pragma GCC optimize("fp-contract=off")  // AVX-512 brings FMA, which would round differently from the other copies
constexpr int kVectorBytes = 64;
#include "logits_rows.inc"
#pragma GCC pop_options
}  // namespace isa_avx512

#define GRPO_CPU_ISA_CALL(isa, ...)                                                           \
  do {                                                                                        \
    switch (isa) {                                                                            \
      case ::grpo_ext::cpu::CpuIsa::kAvx512: ::grpo_ext::cpu::isa_avx512::__VA_ARGS__; break; \
      case ::grpo_ext::cpu::CpuIsa::kAvx2: ::grpo_ext::cpu::isa_avx2::__VA_ARGS__; break;     \
      default: ::grpo_ext::cpu::isa_baseline::__VA_ARGS__;                                    \
    }                                                                                         \
  } while (0)
#else
#define GRPO_CPU_ISA_CALL(isa, ...) ::grpo_ext::cpu::isa_baseline::__VA_ARGS__
#endif

// Two vectorized passes over z[0..n) (n >= 1): the max, then the sums of softmax_sums_loop; `exps` (n values, or
// null) receives exp(z_v - max) for the gradient. In float, from the copy of cpu_isa(): each element is computed
// alone by the same operations and summed into the same lane, so every copy gives the same bits
// (tests/test_cpu_exp.py).
template <typename T>
RowSoftmax row_softmax(const T* z, int64_t n, T* exps) {
  double sums[2];
  T z_max;
  if constexpr (std::is_same_v<T, float>) {
    GRPO_CPU_ISA_CALL(cpu_isa(), softmax_max_sums_float(z, n, exps, sums, z_max));
  } else {
    z_max = softmax_max_sums(z, n, exps, sums);
  }
  const double log_sum = std::log(sums[0]), mean_shift = sums[1] / sums[0];
  return {sums[0], double(z_max) + log_sum, double(z_max) + mean_shift, double(z_max), log_sum, mean_shift};
}

}  // namespace cpu
}  // namespace grpo_ext
