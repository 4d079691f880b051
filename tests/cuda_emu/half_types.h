// cuda_emu's __nv_bfloat16 and __half: the 16-bit storage types and the conversions grpo_ext's kernels call, with
// CUDA's rounding (round to nearest, ties to even; NaN becomes the canonical 0x7fff). Written independently of
// csrc/common.h's decoders, which the kernels under test use. tests/cuda_emu/test_cuda_emu_runtime.py checks them
// against torch's conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t x;
};
struct __half {
  uint16_t x;
};

namespace cuda_emu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t all = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((all >> 16) & 0x8000u);
  const uint32_t u = all & 0x7fffffffu;
  if (u > 0x7f800000u) return 0x7fffu;          // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to infinity
  if (u >= 0x38800000u) {                       // a normal half (2^-14 and above): rebias, round 13 bits off
    const uint32_t r = u - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (u <= 0x33000000u) return sign;  // 2^-25 and below round to zero (2^-25 is a tie, to even)
  // A subnormal half: q * 2^-24 with q = the float's value / 2^-24, rounded to nearest even.
  const uint32_t exponent = u >> 23, mantissa = (u & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24
  uint32_t q = mantissa >> shift;
  const uint32_t rem = mantissa & ((1u << shift) - 1u), half_way = 1u << (shift - 1u);
  if (rem > half_way || (rem == half_way && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

inline float half_bits_to_float(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return mantissa ? NAN : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  return sign * std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
}

}  // namespace cuda_emu

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return {::cuda_emu::float_to_bf16_bits(f)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.x) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
inline __half __float2half_rn(float f) {
  return {::cuda_emu::float_to_half_bits(f)};
}
inline float __half2float(__half h) {
  return ::cuda_emu::half_bits_to_float(h.x);
}

// Pairs of 16-bit values (two lanes of a 32-bit register on the GPU) and the packed max the row kernels take of a
// vector: per lane, the larger; a NaN lane gives the other operand (NaN only when both are), as __hmax2 does.
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2 {
  __half x, y;
};
inline float packed_max_lane(float a, float b) {
  return std::isnan(a) ? b : (std::isnan(b) ? a : (a > b ? a : b));
}
inline __nv_bfloat162 __hmax2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {__float2bfloat16_rn(packed_max_lane(__bfloat162float(a.x), __bfloat162float(b.x))),
          __float2bfloat16_rn(packed_max_lane(__bfloat162float(a.y), __bfloat162float(b.y)))};
}
inline __half2 __hmax2(__half2 a, __half2 b) {
  return {__float2half_rn(packed_max_lane(__half2float(a.x), __half2float(b.x))),
          __float2half_rn(packed_max_lane(__half2float(a.y), __half2float(b.y)))};
}
inline float __low2float(__nv_bfloat162 v) {
  return __bfloat162float(v.x);
}
inline float __high2float(__nv_bfloat162 v) {
  return __bfloat162float(v.y);
}
inline float __low2float(__half2 v) {
  return __half2float(v.x);
}
inline float __high2float(__half2 v) {
  return __half2float(v.y);
}
