// CPU helpers shared by the row-wise kernels: a strided input row as contiguous values, and a reproducible sum.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../common.h"
#include "../fast_math.h"
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

// Notes `row` in `first` if it comes before the row noted there (rows in parallel, whichever thread meets its row
// first): a row loop's errors name the first bad row, as a serial loop would.
inline void note_first_row(std::atomic<int64_t>& first, int64_t row) {
  for (int64_t seen = first.load(); row < seen && !first.compare_exchange_weak(seen, row);) {
  }
}

// A raw logit as the math type T: float16 and bfloat16 through float, float and double as they are.
template <typename T, typename In>
__attribute__((always_inline)) inline T logit_value(In x) {
  if constexpr (std::is_same_v<In, double> || std::is_same_v<In, float>) {
    return static_cast<T>(x);
  } else {
    return static_cast<T>(static_cast<float>(x));
  }
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

// Max of x[0..n) in 16 lanes (lane j takes t = j mod 16); n >= 1. The lanes are GCC vectors of kVectorBytes, the
// caller's vector width (16: SSE, 32: AVX2, 64: AVX-512; a vector wider than the target's is lowered element by
// element): written as an array of 16 scalars, GCC (12) keeps them as 16 scalar chains of a select it does not
// vectorize without -ffast-math. Each lane is x > lane ? x : lane, elementwise, so NaN is skipped and the result is
// that of the scalar loop, bit for bit, whatever the width.
template <typename T, int kVectorBytes = 16>
__attribute__((always_inline)) inline T lane_max(const T* x, int64_t n) {
  constexpr int kLanes = 16, kPerVector = kVectorBytes / sizeof(T), kVectors = kLanes / kPerVector;
  static_assert(kVectors >= 1 && kLanes % kPerVector == 0);
  typedef T Vector __attribute__((vector_size(kVectorBytes)));
  Vector vectors[kVectors];
  for (int i = 0; i < kVectors; ++i) {
    for (int j = 0; j < kPerVector; ++j) vectors[i][j] = x[0];
  }
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int i = 0; i < kVectors; ++i) {
      Vector v;
      memcpy(&v, x + t + i * kPerVector, sizeof(v));
      vectors[i] = v > vectors[i] ? v : vectors[i];
    }
  }
  T lanes[kLanes];
  memcpy(lanes, vectors, sizeof(lanes));
  // A tree (4 dependent selects, not 15); NaN is still skipped: a lane is NaN only when x[0] is, and then all are.
  for (int width = kLanes / 2; width > 0; width >>= 1) {
    for (int j = 0; j < width; ++j) lanes[j] = lanes[j + width] > lanes[j] ? lanes[j + width] : lanes[j];
  }
  T best = lanes[0];
  for (; t < n; ++t) best = x[t] > best ? x[t] : best;
  return best;
}

// Softmax statistics of one scaled logits row, finished in double.
struct RowSoftmax {
  double sum;         // sum_v exp(z_v - max)
  double lse;         // log sum_v exp(z_v)
  double mean_z;      // E_p[z]; the entropy is lse - mean_z
  double max;         // max_v z_v (a T value)
  double log_sum;     // log(sum): lse - max
  double mean_shift;  // E_p[z] - max: the gradients take every z relative to the max (z - max is exact near it)
};

// A fixed tree over 16 float lanes, in double: the lanes' sum in 4 dependent adds (a chain of 16 would cost a short
// row more than its softmax).
template <typename T>
inline double tree_sum16(const T (&lanes)[16]) {
  double level[8];
  for (int j = 0; j < 8; ++j) level[j] = double(lanes[j]) + double(lanes[j + 8]);
  for (int width = 4; width > 0; width >>= 1) {
    for (int j = 0; j < width; ++j) level[j] += level[j + width];
  }
  return level[0];
}

// The row's one loop with an exp, straight-line code that the compiler vectorizes (math_exp_rows is branch-free):
// e_v = exp(d_v) for d_v = z_v - z_max, summed alone and weighted by d_v in 16 float lanes (lane j takes v = j mod
// 16, the last n mod 16 in double), both finished by tree_sum16; with kStore, exps[v] = e_v as well (the gradient's
// p_v = exps[v] / sum). sums = {sum e, sum e d}.
template <typename T, bool kStore>
__attribute__((always_inline)) inline void softmax_sums_loop(const T* __restrict__ z, int64_t n, T z_max,
                                                             T* __restrict__ exps, double (&sums)[2]) {
  constexpr int kLanes = 16;
  // A term below the cut (float: -87, where exp leaves the normal range; double: -100) counts 0, and a -inf logit
  // adds exactly nothing (not 0 * -inf); the exp of such a d is computed and dropped. The test is !(d <= cut), not
  // d > cut: a NaN logit must count and make the row NaN, as in torch.log_softmax (lane_max skips NaN, so nothing
  // else would notice it).
  const auto term = [z_max](T z_v, T& e, T& weighted) {
    const T d = z_v - z_max;
    const bool counts = !(d <= kSoftmaxCut<T>);
    const T exp_d = math_exp_nonpositive(d);
    e = counts ? exp_d : T(0);
    weighted = counts ? exp_d * d : T(0);
  };
  T lane_e[kLanes] = {}, lane_w[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      T e, weighted;
      term(z[v + j], e, weighted);
      if constexpr (kStore) exps[v + j] = e;
      lane_e[j] += e;
      lane_w[j] += weighted;
    }
  }
  double tail_e = 0.0, tail_w = 0.0;
  for (; v < n; ++v) {
    T e, weighted;
    term(z[v], e, weighted);
    if constexpr (kStore) exps[v] = e;
    tail_e += double(e);
    tail_w += double(weighted);
  }
  sums[0] = tree_sum16(lane_e) + tail_e;
  sums[1] = tree_sum16(lane_w) + tail_w;
}

// The row's max (lane_max), then softmax_sums_loop, storing exps only where they are asked for (exps != nullptr: the
// gradient needs them); returns the max.
template <typename T, int kVectorBytes = 16>
__attribute__((always_inline)) inline T softmax_max_sums(const T* z, int64_t n, T* exps, double (&sums)[2]) {
  const T z_max = lane_max<T, kVectorBytes>(z, n);
  if (exps != nullptr) {
    softmax_sums_loop<T, true>(z, n, z_max, exps, sums);
  } else {
    softmax_sums_loop<T, false>(z, n, z_max, exps, sums);
  }
  return z_max;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC on x86-64: the row loops are compiled again for AVX2 and AVX-512 (function targets; logits_rows.h, and the
// loss token loop in grpo_loss.cpp), picked at run time by cpu_isa().
#define GRPO_EXT_X86_AVX2 1
#endif

// The widest vector instructions the CPU kernels use on this machine, asked once: AVX-512 (F, BW, DQ and VL: every
// AVX-512 x86 server CPU since Skylake-X; BW is what converts bfloat16 and float16 rows 16 at a time), else AVX2, else
// the baseline. ATEN_CPU_CAPABILITY caps it as it caps torch's own kernels ("default": the baseline; "avx2"), so that
// one machine can run every copy.
enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline CpuIsa detect_cpu_isa() {
#ifdef GRPO_EXT_X86_AVX2
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  CpuIsa isa = avx512 ? CpuIsa::kAvx512 : __builtin_cpu_supports("avx2") ? CpuIsa::kAvx2 : CpuIsa::kBaseline;
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap != nullptr) {
    const CpuIsa most = std::strcmp(cap, "default") == 0 ? CpuIsa::kBaseline
                        : std::strcmp(cap, "avx2") == 0  ? CpuIsa::kAvx2
                                                         : CpuIsa::kAvx512;
    if (most < isa) isa = most;
  }
  return isa;
#else
  return CpuIsa::kBaseline;
#endif
}

inline CpuIsa cpu_isa() {
  static const CpuIsa isa = detect_cpu_isa();
  return isa;
}

// Whether the AVX2 copies may run (every CPU kernel's AVX2 copy is chosen by it).
inline bool cpu_has_avx2() {
  return cpu_isa() >= CpuIsa::kAvx2;
}

}  // namespace cpu
}  // namespace grpo_ext
