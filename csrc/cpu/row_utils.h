// CPU helpers shared by the row-wise kernels: a strided input row as contiguous values, and a reproducible sum.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common.h"
#include "../grpo_loss_math.h"

namespace grpo_ext {
namespace cpu {

// A row of a strided input as contiguous T: the data itself when it already is, else converted into `buffer`.
// Hoisting the dtype switch out of the token loop is what keeps that loop cheap.
template <typename T>
const T* row_values(const StridedMatrix& m, int64_t row, int64_t n, T* buffer) {
  if (!m.present()) return nullptr;
  constexpr DType kSame = sizeof(T) == sizeof(double) ? DType::kFloat64 : DType::kFloat32;
  if (m.dtype == kSame && m.col_stride == 1) return static_cast<const T*>(m.data) + row * m.row_stride;
  if (m.col_stride == 0) {
    const T v = m.load<T>(row, 0);
    for (int64_t t = 0; t < n; ++t) buffer[t] = v;
    return buffer;
  }
  switch (m.dtype) {  // one switch per row; each loop below vectorizes
#define GRPO_CONVERT_ROW(tag, ctype, expr)                                     \
  case DType::tag: {                                                           \
    const ctype* src = static_cast<const ctype*>(m.data) + row * m.row_stride; \
    for (int64_t t = 0; t < n; ++t) {                                          \
      const ctype x = src[t * m.col_stride];                                   \
      buffer[t] = static_cast<T>(expr);                                        \
    }                                                                          \
    return buffer;                                                             \
  }
    GRPO_CONVERT_ROW(kFloat32, float, x)
    GRPO_CONVERT_ROW(kFloat64, double, x)
    GRPO_CONVERT_ROW(kBFloat16, uint16_t, bf16_bits_to_float(x))
    GRPO_CONVERT_ROW(kFloat16, uint16_t, f16_bits_to_float(x))
    GRPO_CONVERT_ROW(kBool, uint8_t, x)
    GRPO_CONVERT_ROW(kUInt8, uint8_t, x)
    GRPO_CONVERT_ROW(kInt8, int8_t, x)
    GRPO_CONVERT_ROW(kInt32, int32_t, x)
    GRPO_CONVERT_ROW(kInt64, int64_t, x)
#undef GRPO_CONVERT_ROW
  }
  return buffer;
}

// Sum of x[0..n) in 16 interleaved float lanes (vectorized; a fixed order, so reproducible), finished in double.
template <typename T>
double lane_sum(const T* x, int64_t n) {
  constexpr int kLanes = 16;
  T lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[t + j];
  }
  double total = 0.0;
  for (int j = 0; j < kLanes; ++j) total += double(lanes[j]);
  for (; t < n; ++t) total += double(x[t]);
  return total;
}

// Max of x[0..n) in 16 lanes (vectorizes without -ffast-math); n >= 1.
template <typename T>
T lane_max(const T* x, int64_t n) {
  constexpr int kLanes = 16;
  T lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = x[0];
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
  }
  T best = lanes[0];
  for (int j = 1; j < kLanes; ++j) best = lanes[j] > best ? lanes[j] : best;
  for (; t < n; ++t) best = x[t] > best ? x[t] : best;
  return best;
}

// Softmax statistics of one scaled logits row, finished in double.
struct RowSoftmax {
  double sum;     // sum_v exp(z_v - max)
  double lse;     // log sum_v exp(z_v)
  double mean_z;  // E_p[z]; the entropy is lse - mean_z
};

// Two vectorized passes over z[0..n) (n >= 1): the max, then exps[v] = exp(z_v - max), which the caller may reuse
// for the gradient (p_v = exps[v] / sum). `weighted` is scratch of n values.
template <typename T>
RowSoftmax row_softmax(const T* z, int64_t n, T* exps, T* weighted) {
  const T z_max = lane_max(z, n);
  for (int64_t v = 0; v < n; ++v) {
    const T d = z[v] - z_max;
    // exp underflows to 0 below -88 in float anyway; a -inf logit adds exactly nothing (not 0 * -inf). The test is
    // !(d <= -100), not d > -100: a NaN logit must count and make the row NaN, as in torch.log_softmax (lane_max
    // skips NaN, so nothing else would notice it).
    const bool counts = !(d <= T(-100));
    const T e = math_exp(counts ? d : T(-100));
    exps[v] = counts ? e : T(0);
    weighted[v] = counts ? e * d : T(0);
  }
  const double sum = lane_sum(exps, n);
  return {sum, double(z_max) + std::log(sum), double(z_max) + lane_sum(weighted, n) / sum};
}

}  // namespace cpu
}  // namespace grpo_ext
