// The logits options of docs/math.md section 2, written once for the CPU and CUDA kernels: from raw logits x,
// y = logit_scale * x, then y = logit_softcap * tanh(y / logit_softcap) when a cap is given (Cohere's scale, Gemma 2's
// final soft-capping, in that order), then z = y / temperature. Float math in the kernels whatever the dtype.
#pragma once

#include <cmath>
#include <type_traits>

#include "common.h"

namespace grpo_ext {

// Which soft-cap code a kernel compiles, as a template argument: none, the tanh cap, or either behind the run-time
// flag LogitTransform::capped (one kernel for both).
enum class SoftCap : int { kOff = 0, kOn = 1, kRuntime = 2 };

// a * b rounded to T, never fused with a following add or subtract. nvcc contracts z - max, with z = x * scale, into
// one FMA that does not round z first: at the row's max itself z - max is then the product's rounding error
// instead of 0, so that the max's exp(0) term is 1 + 2e-6 and a confident token's log-prob, exactly 0 in float64,
// is -2e-6 (seen on an H100; CPU code is built without FMA, where a * b already rounds).
template <typename T>
GRPO_HD T mul_rounded(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
#else
  return a * b;
#endif
}

template <typename T>
struct LogitTransform {
  T in_scale = T(1);       // uncapped: x -> z (logit_scale / temperature); capped: x -> the tanh argument
  T out_scale = T(1);      // capped: logit_softcap / temperature
  T inv_out_scale = T(1);  // capped: 1 / out_scale (tanh recovered from z)
  T slope = T(1);          // logit_scale / temperature: dz/dx without a cap, and its factor with one
  bool capped = false;

  // z of a raw logit, the cap chosen at compile time (CPU loops) or at run time (CUDA: a uniform branch).
  template <bool kCapped>
  GRPO_HD T z_of(T x) const {
    using std::tanh;
    return kCapped ? mul_rounded(out_scale, T(tanh(in_scale * x))) : mul_rounded(x, in_scale);
  }
  GRPO_HD T operator()(T x) const { return capped ? z_of<true>(x) : z_of<false>(x); }

  // d = z - max of a raw logit, for a max of z. Without a cap one FMA, x * in_scale - max rounded once, where z then
  // a subtraction took two instructions and rounded z first: the CUDA kernels take every d of a row this way (its
  // statistics, its chosen token, its gradient), so that they agree. At the max itself d is then the product's
  // rounding error, not 0, and every term of the row sees the same max: the chosen token's logp = d - log(sum)
  // stays exact for a confident token (mul_rounded's failure was the two forms mixed in one row).
  template <bool kCapped>
  GRPO_HD T d_of(T x, T max) const {
    using std::fma;
    return kCapped ? z_of<true>(x) - max : fma(x, in_scale, -max);
  }
  GRPO_HD T d_at(T x, T max) const { return capped ? d_of<true>(x, max) : d_of<false>(x, max); }
  // z = x exactly (no cap, a scale of 1): a row of the math type can be read where it lies.
  GRPO_HD bool is_identity() const { return !capped && in_scale == T(1); }

  // dz/dx at the logit whose z is given: slope * (1 - tanh^2), with tanh = z / out_scale (no second tanh).
  template <bool kCapped>
  GRPO_HD T slope_of(T z) const {
    if (!kCapped) return slope;
    const T t = z * inv_out_scale;
    return slope * (T(1) - t * t);
  }
  GRPO_HD T slope_at(T z) const { return capped ? slope_of<true>(z) : slope_of<false>(z); }

  // z_of and slope_of for a SoftCap kernel argument (kOff, kOn: that code only, whatever `capped` says).
  template <SoftCap kCap>
  GRPO_HD T z_with(T x) const {
    if constexpr (kCap == SoftCap::kRuntime) return (*this)(x);
    return z_of < kCap == SoftCap::kOn > (x);
  }
  template <SoftCap kCap>
  GRPO_HD T d_with(T x, T max) const {
    if constexpr (kCap == SoftCap::kRuntime) return d_at(x, max);
    return d_of < kCap == SoftCap::kOn > (x, max);
  }
  template <SoftCap kCap>
  GRPO_HD T slope_with(T z) const {
    if constexpr (kCap == SoftCap::kRuntime) return slope_at(z);
    return slope_of < kCap == SoftCap::kOn > (z);
  }
};

// body(cap) with f's cap as a compile-time SoftCap (a std::integral_constant): kOn or kOff, chosen on the host
// (a kernel's template argument) or by one uniform branch around a row loop, so that the loop holds only the code it
// runs (the tanh path in the uncapped loop had cost the float32 selective backward 20 registers, 32 -> 52, half the
// occupancy at 1024 threads); kRuntime in double precision, the reference dtype, where ptxas keeps either
// compile-time kernel at 32 registers with spills (the uncapped selective forward 240 B) but the run-time one at 52
// without.
template <typename T, typename Body>
GRPO_HD void with_soft_cap(const LogitTransform<T>& f, Body&& body) {
  if constexpr (std::is_same_v<T, double>) {
    body(std::integral_constant<SoftCap, SoftCap::kRuntime>());
  } else if (f.capped) {
    body(std::integral_constant<SoftCap, SoftCap::kOn>());
  } else {
    body(std::integral_constant<SoftCap, SoftCap::kOff>());
  }
}

// logit_softcap <= 0 means no cap (the ops' schemas take 0 for None); the planning checks the values.
template <typename T>
inline LogitTransform<T> make_logit_transform(double temperature, double logit_scale, double logit_softcap) {
  LogitTransform<T> f;
  f.slope = T(logit_scale / temperature);
  f.capped = logit_softcap > 0;
  if (f.capped) {
    f.in_scale = T(logit_scale / logit_softcap);
    f.out_scale = T(logit_softcap / temperature);
    f.inv_out_scale = T(temperature / logit_softcap);
  } else {
    f.in_scale = f.slope;
  }
  return f;
}

}  // namespace grpo_ext
