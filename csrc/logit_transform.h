// The logits options of docs/math.md section 2, written once for the CPU and CUDA kernels: from raw logits x,
// y = logit_scale * x, then y = logit_softcap * tanh(y / logit_softcap) when a cap is given (Cohere's scale, Gemma 2's
// final soft-capping, in that order), then z = y / temperature. Float math in the kernels whatever the dtype.
#pragma once

#include <cmath>

#include "common.h"

namespace grpo_ext {

// Which soft-cap code a kernel compiles, as a template argument: none, the tanh cap, or either behind the run-time
// flag LogitTransform::capped (one kernel for both).
enum class SoftCap : int { kOff = 0, kOn = 1, kRuntime = 2 };

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
    return kCapped ? out_scale * tanh(in_scale * x) : x * in_scale;
  }
  GRPO_HD T operator()(T x) const { return capped ? z_of<true>(x) : z_of<false>(x); }

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
  GRPO_HD T slope_with(T z) const {
    if constexpr (kCap == SoftCap::kRuntime) return slope_at(z);
    return slope_of < kCap == SoftCap::kOn > (z);
  }
};

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
