// exp and expm1 for the kernels: the library functions on the device and in double precision, vectorizable
// branch-free versions in host float code (the CPU token loops).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace grpo_ext {

// exp and expm1 as the kernels use them. On the device and in double precision: the library functions. In host
// float code: branch-free versions the compiler can vectorize (Cody-Waite reduction and a degree-7 polynomial,
// within 2 ulp, host_expf_rows below), because glibc's scalar calls would stop the token loop from vectorizing.
#if !defined(__CUDA_ARCH__)
// exp(r) for |r| <= ln2 / 2 by its Taylor polynomial of degree 7 (truncation below 1e-8 relative), in Horner form
// with no FMA, so that every copy of a loop rounds alike.
inline float expf_taylor7(float r) {
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// x = k ln2 + r, k = round(x / ln2) (as an integer), ln2 in two parts (the first of few bits, so that k times it is
// exact), |r| <= ln2 / 2; for |x| below about 2^22.
struct ExpReduction {
  int32_t k;
  float r;
};
inline ExpReduction exp_reduction(float x) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23: x * log2(e) + shifter holds round(x * log2(e)) in its low bits
  const float shifted = x * 1.44269504088896341f + shifter;
  const float n = shifted - shifter;
  uint32_t shifted_bits;
  memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  return {static_cast<int32_t>(shifted_bits - 0x4B400000u), (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f};
}

// exp for the softmax rows of the logits ops (cpu::row_softmax and the CPU backward of selective_log_softmax), in
// float, within 2 ulp of the correctly rounded exp (tests/test_cpu_exp.py) and branch-free, so that the row loops
// vectorize: x reduced to k ln2 + r (exp_reduction); exp(r) by its Taylor polynomial of degree 7 (truncation below
// 1e-8 relative); the result scaled by 2^k through exponent bits, in two halves 2^(k/2) * 2^(k - k/2), so that a
// subnormal result (x below -87.34) is rounded once, as IEEE gradual underflow does: 0 below -103.97 and at -inf,
// inf above 88.72, NaN for NaN, as exp in float (the token loops' exp too: a clamp to [-87, 88] there once made a
// ratio of e^100 1.65e38, not inf, and e^88.5 wrong by 40%). No FMA (none is enabled, and the AVX-512
// copies are compiled without contraction), so that every copy of a loop gives the same bits.
inline float host_expf_rows(float x) {
  x = x < -104.0f ? -104.0f : x;  // exp(-104) < 2^-150 rounds to 0; NaN passes both clamps (comparisons are false)
  x = x > 89.0f ? 89.0f : x;      // exp(89) > FLT_MAX: inf
  const ExpReduction e = exp_reduction(x);  // k in [-150, 128]
  const float p = expf_taylor7(e.r);
  const int32_t k_low = e.k >> 1, k_high = e.k - k_low;  // each in [-75, 64]: both halves are normal floats
  const uint32_t low_bits = (static_cast<uint32_t>(k_low) + 127u) << 23;
  const uint32_t high_bits = (static_cast<uint32_t>(k_high) + 127u) << 23;
  float low, high;
  memcpy(&low, &low_bits, sizeof(low));
  memcpy(&high, &high_bits, sizeof(high));
  return (p * low) * high;  // p * 2^k_low is exact; the second product rounds once (to inf, or to a subnormal)
}

// exp(d) for the softmax sums' d = z - max in [kSoftmaxCutFloat, 0] (and NaN -> NaN): host_expf_rows' steps without
// its clamps and split scale, since there 2^n is a normal float and the one product rounds once; the same bits as
// host_expf_rows over that range, in about a fifth fewer vector instructions per element. Anything below the cut
// (-inf included) gives garbage, which the caller drops: such a d counts 0, as its exp is below float's normal range
// (CUDA's __expf gives 0 there too).
inline constexpr float kSoftmaxCutFloat = -87.0f;
inline float host_expf_nonpositive(float d) {
  const ExpReduction e = exp_reduction(d);  // k in [-126, 0]
  const uint32_t scale_bits = (static_cast<uint32_t>(e.k) + 127u) << 23;
  float scale;
  memcpy(&scale, &scale_bits, sizeof(scale));
  return expf_taylor7(e.r) * scale;
}
#endif

template <typename T>
GRPO_HD T math_exp(T x) {
  using std::exp;
  return exp(x);
}
template <typename T>
GRPO_HD T math_expm1(T x) {
  using std::expm1;
  return expm1(x);
}
// The exp of the softmax rows: host_expf_rows in host float code, std::exp in double.
template <typename T>
inline T math_exp_rows(T x) {
  return std::exp(x);
}
// The softmax sums' exp of d = z - max <= 0 and where below it a term counts 0: host_expf_nonpositive above
// kSoftmaxCutFloat in host float code; std::exp above -100 in double.
template <typename T>
inline constexpr T kSoftmaxCut = T(-100);
template <typename T>
inline T math_exp_nonpositive(T d) {
  return std::exp(d);
}
#if !defined(__CUDA_ARCH__)
template <>
inline float math_exp_rows<float>(float x) {
  return host_expf_rows(x);
}
template <>
inline constexpr float kSoftmaxCut<float> = kSoftmaxCutFloat;
template <>
inline float math_exp_nonpositive<float>(float d) {
  return host_expf_nonpositive(d);
}
template <>
inline float math_exp<float>(float x) {
  return host_expf_rows(x);
}
template <>
inline float math_expm1<float>(float r) {
  // Where exp(r) - 1 would cancel, the series r + r^2/2! + ... + r^7/7! (truncation below 2e-11 relative).
  const float series =
      r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
  const float direct = host_expf_rows(r) - 1.f;
  return ((r > -0.125f) & (r < 0.125f)) ? series : direct;
}
#endif

}  // namespace grpo_ext
