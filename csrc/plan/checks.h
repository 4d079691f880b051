// Host-side checks shared by every op's planning header: dtype tags, TORCH_CHECKs that name the argument, and
// torch tensor -> StridedMatrix views. Kernels never see a torch type.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <string>

#include "../common.h"
#include "../logit_transform.h"
#include "../option_choices.h"

namespace grpo_ext {

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline DType dtype_tag(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    case at::kBool: return DType::kBool;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
  return DType::kFloat32;
}

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_float_type(t.scalar_type()), name,
              " must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* name, const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), name, " must be on the same device as ", like_name, " (", like.device(),
              "), got ", t.device());
}

// A [rows, cols] view of `t`, which may be [rows, cols], [rows, 1] or [rows] (the last two broadcast over cols).
inline StridedMatrix matrix_view(const at::Tensor& t, int64_t rows, int64_t cols, const char* name,
                                 bool allow_row_vector) {
  StridedMatrix v;
  const DType dtype = dtype_tag(t.scalar_type(), name);
  if (strided_matrix_of(t.data_ptr(), dtype, t.dim(), t.sizes().data(), t.strides().data(), rows, cols,
                        allow_row_vector, &v)) {
    return v;
  }
  TORCH_CHECK(allow_row_vector, name, " must have shape [", rows, ", ", cols, "], got ", t.sizes());
  TORCH_CHECK(false, name, " must have shape [", rows, "], [", rows, ", 1] or [", rows, ", ", cols, "], got ",
              t.sizes());
  return v;
}

inline std::string to_string(c10::string_view s) {
  return std::string(s.data(), s.size());
}

// `value` parsed against `choices`; anything else is an error naming the option and what it accepts.
template <typename E, size_t N>
E parse_choice(const char* option, c10::string_view value, const Choice<E> (&choices)[N]) {
  const std::string v = to_string(value);
  std::string accepted;
  for (const Choice<E>& c : choices) {
    if (v == c.name) return c.value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(c.name);
  }
  TORCH_CHECK(false, option, " must be one of ", accepted, "; got '", v, "'");
  return choices[0].value;
}

// Statistics are float64 for float64 inputs and float32 otherwise (docs/math.md: float32 accumulation at least).
inline at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
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
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  TORCH_CHECK(std::isfinite(logit_scale) && logit_scale > 0, "logit_scale must be finite and > 0, got ", logit_scale);
  TORCH_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0,
              "logit_softcap must be finite and > 0 (0 for no cap), got ", logit_softcap);
  return {temperature, logit_scale, logit_softcap};
}

}  // namespace grpo_ext
