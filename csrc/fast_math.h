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
// within 2 ulp over the range), because glibc's scalar calls would stop the token loop from vectorizing.
#if !defined(__CUDA_ARCH__)
inline float host_expf(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and removing it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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
#if !defined(__CUDA_ARCH__)
template <>
inline float math_exp<float>(float x) {
  return host_expf(x);
}
template <>
inline float math_expm1<float>(float r) {
  // Where exp(r) - 1 would cancel, the series r + r^2/2! + ... + r^7/7! (truncation below 2e-11 relative).
  const float series =
      r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
  const float direct = host_expf(r) - 1.f;
  return ((r > -0.125f) & (r < 0.125f)) ? series : direct;
}
#endif

}  // namespace grpo_ext
