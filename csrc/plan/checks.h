// Host-side checks shared by every op's planning header: dtype tags, GRPO_CHECKs that name the argument, and
// torch tensor -> StridedMatrix views. Kernels never see a torch type.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <string_view>

#include "../common.h"
#include "../logit_transform.h"
#include "../option_choices.h"
#include "stable_api.h"

namespace grpo_ext {

inline bool is_float_type(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

inline DType dtype_tag(ScalarType t, const char* name) {
  switch (t) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Double: return DType::kFloat64;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::Bool: return DType::kBool;
    case ScalarType::Byte: return DType::kUInt8;
    case ScalarType::Char: return DType::kInt8;
    case ScalarType::Int: return DType::kInt32;
    case ScalarType::Long: return DType::kInt64;
    default: fail(name, ": unsupported dtype ", t);
  }
}

inline void check_float(const Tensor& t, const char* name) {
  GRPO_CHECK(is_float_type(t.scalar_type()), name,
             " must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", t.scalar_type());
}

inline void check_same_device(const Tensor& t, const Tensor& like, const char* name, const char* like_name) {
  GRPO_CHECK(same_device(t, like), name, " must be on the same device as ", like_name, " (", device_name(like),
             "), got ", device_name(t));
}

// A [rows, cols] view of `t`, which may be [rows, cols], [rows, 1] or [rows] (the last two broadcast over cols).
inline StridedMatrix matrix_view(const Tensor& t, int64_t rows, int64_t cols, const char* name, bool allow_row_vector) {
  StridedMatrix v;
  const DType dtype = dtype_tag(t.scalar_type(), name);
  if (strided_matrix_of(t.data_ptr(), dtype, t.dim(), t.sizes().data(), t.strides().data(), rows, cols,
                        allow_row_vector, &v)) {
    return v;
  }
  GRPO_CHECK(allow_row_vector, name, " must have shape [", rows, ", ", cols, "], got ", shape(t));
  fail(name, " must have shape [", rows, "], [", rows, ", 1] or [", rows, ", ", cols, "], got ", shape(t));
}

// `value` parsed against `choices`; anything else is an error naming the option and what it accepts.
template <typename E, size_t N>
E parse_choice(const char* option, std::string_view value, const Choice<E> (&choices)[N]) {
  const std::string v(value);
  std::string accepted;
  for (const Choice<E>& c : choices) {
    if (v == c.name) return c.value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(c.name);
  }
  fail(option, " must be one of ", accepted, "; got '", v, "'");
}

// Statistics are float64 for float64 inputs and float32 otherwise (docs/math.md: float32 accumulation at least).
inline ScalarType accumulate_type(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

// The logits options of docs/math.md section 2 as the ops take them (logit_softcap 0: no cap), checked once.
struct LogitOptions {
  double temperature = 1.0, logit_scale = 1.0, logit_softcap = 0.0;
  template <typename T>
  LogitTransform<T> transform() const {
    return make_logit_transform<T>(temperature, logit_scale, logit_softcap);
  }
};

inline LogitOptions check_logit_options(double temperature, double logit_scale, double logit_softcap) {
  GRPO_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  GRPO_CHECK(std::isfinite(logit_scale) && logit_scale > 0, "logit_scale must be finite and > 0, got ", logit_scale);
  GRPO_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0,
             "logit_softcap must be finite and > 0 (0 for no cap), got ", logit_softcap);
  // The kernels' factors (make_logit_transform), in float32: inf or 0 there would make every log-prob NaN.
  const auto check_factor = [](double value, const char* what) {
    GRPO_CHECK(value >= std::numeric_limits<float>::min() && value <= std::numeric_limits<float>::max(), what,
               " must be a normal float32 number (1.2e-38 to 3.4e38), got ", value);
  };
  check_factor(logit_scale / temperature, "logit_scale / temperature");
  if (logit_softcap > 0) {
    check_factor(logit_scale / logit_softcap, "logit_scale / logit_softcap");
    check_factor(logit_softcap / temperature, "logit_softcap / temperature");
  }
  return {temperature, logit_scale, logit_softcap};
}

}  // namespace grpo_ext
