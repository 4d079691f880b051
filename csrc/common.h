// Framework-free building blocks shared by the CPU and CUDA kernels: the host/device qualifier, a strided 2-D view
// that reads any supported dtype as float/double, and the option codes the bindings parse from strings.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GRPO_HD __host__ __device__ __forceinline__
#else
#define GRPO_HD inline
#endif

namespace grpo_ext {

// selective_log_softmax's per-row statistics, which its forward keeps for the backward ([N, kSoftmaxStats]): the
// row's largest z, log sum_v exp(z_v - max) and E_p[z] - max. Relative to the max, so that the backward takes each z
// as z - max (exact near it) and large logits keep their precision, where z - lse with lse rounded costs an ulp of
// |z| (1e-3 at z = 1e4).
constexpr int kSoftmaxStats = 3;

// Element types a kernel can read; the bindings map torch dtypes onto these tags.
enum class DType : int32_t { kFloat32 = 0, kFloat64, kBFloat16, kFloat16, kBool, kUInt8, kInt8, kInt32, kInt64 };

// Bytes per element of a DType.
GRPO_HD int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: return 1;
  }
}

GRPO_HD float bf16_bits_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// IEEE half -> float, exact for every half value (subnormals, inf, NaN included).
GRPO_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1fu) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    u = sign;
  } else {  // subnormal: normalize
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    u = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Read-only [rows, cols] view with element strides; a stride of 0 broadcasts ([B] advantages over T, say).
struct StridedMatrix {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t row_stride = 0;
  int64_t col_stride = 0;

  GRPO_HD bool present() const { return data != nullptr; }

  template <typename T>
  GRPO_HD T load(int64_t row, int64_t col) const {
    const int64_t off = row * row_stride + col * col_stride;
    switch (dtype) {
      case DType::kFloat32: return static_cast<T>(static_cast<const float*>(data)[off]);
      case DType::kFloat64: return static_cast<T>(static_cast<const double*>(data)[off]);
      case DType::kBFloat16: return static_cast<T>(bf16_bits_to_float(static_cast<const uint16_t*>(data)[off]));
      case DType::kFloat16: return static_cast<T>(f16_bits_to_float(static_cast<const uint16_t*>(data)[off]));
      case DType::kBool:
      case DType::kUInt8: return static_cast<T>(static_cast<const uint8_t*>(data)[off]);
      case DType::kInt8: return static_cast<T>(static_cast<const int8_t*>(data)[off]);
      case DType::kInt32: return static_cast<T>(static_cast<const int32_t*>(data)[off]);
      case DType::kInt64: return static_cast<T>(static_cast<const int64_t*>(data)[off]);
    }
    return T(0);
  }
};

// Rows of [R, V] or [B', T', V] logits (row r = (r / inner, r % inner)), each row contiguous over V.
struct LogitsRows {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0, vocab = 0, inner = 1, stride_outer = 0, stride_inner = 0;

  GRPO_HD int64_t offset(int64_t r) const { return (r / inner) * stride_outer + (r % inner) * stride_inner; }
};

// The views of a tensor given as data, dtype, sizes and strides, for host code: the plans build them from at::Tensor
// (plan/checks.h, plan/grpo_loss_from_logits.h) and tests/cuda_emu from its own tensors.

// A [rows, cols] view of a [rows, cols] tensor or, when `allow_row_vector`, of a [rows, 1] or [rows] one (broadcast
// over cols). False when the shape is none of these.
inline bool strided_matrix_of(const void* data, DType dtype, int64_t dim, const int64_t* sizes, const int64_t* strides,
                              int64_t rows, int64_t cols, bool allow_row_vector, StridedMatrix* view) {
  view->data = data;
  view->dtype = dtype;
  if (dim == 2 && sizes[0] == rows && sizes[1] == cols) {
    view->row_stride = strides[0];
    view->col_stride = cols == 1 ? 0 : strides[1];
    return true;
  }
  const bool row_vector = (dim == 1 && sizes[0] == rows) || (dim == 2 && sizes[0] == rows && sizes[1] == 1);
  if (!allow_row_vector || !row_vector) return false;
  view->row_stride = strides[0];
  view->col_stride = 0;
  return true;
}

// The rows of [R, V] (dim 2) or [B', T', V] (dim 3) logits whose last dimension is contiguous.
inline LogitsRows logits_rows_of(const void* data, DType dtype, int64_t dim, const int64_t* sizes,
                                 const int64_t* strides) {
  LogitsRows rows;
  rows.data = data;
  rows.dtype = dtype;
  rows.vocab = sizes[dim - 1];
  if (dim == 2) {
    rows.rows = sizes[0];
    rows.inner = rows.rows > 0 ? rows.rows : 1;
    rows.stride_outer = 0;
    rows.stride_inner = strides[0];
  } else {
    rows.rows = sizes[0] * sizes[1];
    rows.inner = sizes[1] > 0 ? sizes[1] : 1;
    rows.stride_outer = strides[0];
    rows.stride_inner = strides[1];
  }
  return rows;
}

// Option codes, parsed once on the host from the user's strings.
enum class LossType : int32_t { kGRPO = 0, kBNPO, kDrGRPO, kDAPO, kLUSPO, kCISPO, kSAPO, kVESPO };
// kAbs, kK1Plus, kK3Plus, kLowVarKL: verl's "abs", straight-through "k1+"/"k3+" and "low_var_kl" (docs/math.md 4).
enum class KLEstimator : int32_t { kK1 = 1, kK2 = 2, kK3 = 3, kAbs, kK1Plus, kK3Plus, kLowVarKL };
enum class ScaleRewards : int32_t { kGroup = 0, kBatch, kNone };
enum class Baseline : int32_t { kMean = 0, kLeaveOneOut };
enum class Aggregation : int32_t { kSumThenNormalize = 0, kNormalizeThenSum };

}  // namespace grpo_ext
