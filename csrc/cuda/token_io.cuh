// Chunked reads of the loss op's [B, T] inputs (StridedMatrix views of any dtype): a thread takes K consecutive tokens
// of a row and reads each input's K elements with one access (K * element bytes: 16 for float32 with K = 4, float64
// with K = 2; 8 for bf16/fp16, 4 for a bool mask), where every input of the row allows it: unit column stride (or a
// [B] input broadcast over T) and the chunk on a K-element boundary of each. A row that does not (a strided or
// transposed input, inputs at different offsets) is read token by token, K tokens a blockDim.x apart per thread.
//
// The tokens of a row go to the same thread on every run (for a given alignment, T and blockDim): deterministic sums.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common.h"

namespace grpo_ext {

// K elements of one type moved as one access (two 16-byte ones above 16 bytes).
template <typename E, int K>
struct alignas(sizeof(E) * K) Pack {
  E v[K];
};

// The byte address of element (row, col) of m.
GRPO_HD uintptr_t element_address(const StridedMatrix& m, int64_t row, int64_t col) {
  return reinterpret_cast<uintptr_t>(m.data) +
         uintptr_t((row * m.row_stride + col * m.col_stride) * dtype_bytes(m.dtype));
}

// Tokens before the first K-element boundary of row `row` of m (unit column stride), at most n.
template <int K>
GRPO_HD int64_t chunk_head(const StridedMatrix& m, int64_t row, int64_t n) {
  const int64_t bytes = dtype_bytes(m.dtype);
  const int64_t past = int64_t(element_address(m, row, 0) / uintptr_t(bytes) % K);
  const int64_t head = (K - past) % K;
  return head < n ? head : n;
}

// Whether m (absent, broadcast over T, or unit stride) allows K-element accesses at token `start` of row `row`.
template <int K>
GRPO_HD bool chunk_aligned(const StridedMatrix& m, int64_t row, int64_t start) {
  if (!m.present() || m.col_stride == 0) return true;
  return m.col_stride == 1 && element_address(m, row, start) % uintptr_t(K * dtype_bytes(m.dtype)) == 0;
}

template <typename T, typename E, int K>
__device__ __forceinline__ void load_pack(const void* data, int64_t offset, T (&out)[K]) {
  const Pack<E, K> p = *reinterpret_cast<const Pack<E, K>*>(static_cast<const E*>(data) + offset);
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = static_cast<T>(p.v[k]);
}

// The dtypes read in whole chunks: a value input in the accumulation type T itself (no conversion code per dtype:
// what keeps the kernel's code, and its registers, small), a mask as bool/uint8, int32, int64 or float32. Rows with
// other dtypes are read token by token.
template <typename T>
GRPO_HD bool chunk_dtype(const StridedMatrix& m, bool is_mask) {
  if (!is_mask) return m.dtype == (sizeof(T) == 8 ? DType::kFloat64 : DType::kFloat32);
  return m.dtype == DType::kBool || m.dtype == DType::kUInt8 || m.dtype == DType::kInt32 || m.dtype == DType::kInt64 ||
         m.dtype == DType::kFloat32;
}

// out[k] = m[row, t + k], k < K, with one access (chunk_aligned at t, chunk_dtype), or m[row, 0] K times for a
// broadcast input.
template <typename T, int K>
__device__ __forceinline__ void load_chunk(const StridedMatrix& m, int64_t row, int64_t t, bool is_mask, T (&out)[K]) {
  if (m.col_stride == 0) {
    const T v = m.load<T>(row, 0);
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = v;
    return;
  }
  const int64_t offset = row * m.row_stride + t;
  if (!is_mask) return load_pack<T, T>(m.data, offset, out);
  switch (m.dtype) {
    case DType::kInt32: load_pack<T, int32_t>(m.data, offset, out); break;
    case DType::kInt64: load_pack<T, int64_t>(m.data, offset, out); break;
    case DType::kFloat32: load_pack<T, float>(m.data, offset, out); break;
    default: load_pack<T, uint8_t>(m.data, offset, out); break;  // bool, uint8
  }
}

// a[k] and a[k] = v for a k known at run time only, as selects: the array stays in registers.
template <typename T, int K>
GRPO_HD T pick(const T (&a)[K], int k) {
  T v = a[0];
#pragma unroll
  for (int j = 1; j < K; ++j) v = k == j ? a[j] : v;
  return v;
}
template <typename T, int K>
GRPO_HD void put(T (&a)[K], int k, T v) {
#pragma unroll
  for (int j = 0; j < K; ++j) a[j] = k == j ? v : a[j];
}

// A thread's chunk of a row: tokens t0 + k * step, k < K. `whole`: the K tokens are consecutive, inside [0, n) and
// on a K-element boundary of every input (load_chunk); otherwise each token is read alone, 0 outside [0, n).
struct TokenChunk {
  int64_t t0, step;
  bool whole;
  GRPO_HD int64_t token(int k) const { return t0 + k * step; }
};

// out[k] = m[row, token k] for the chunk's tokens: one access for a whole chunk; token by token otherwise (a loop
// not unrolled: one copy of the dtype dispatch), reading only tokens inside [0, n) whose `kept` entry is not 0 (0
// for the others). `kept` null: every token in [0, n).
template <typename T, int K>
__device__ __forceinline__ void load_tokens(const StridedMatrix& m, int64_t row, int64_t n, const TokenChunk& c,
                                            T (&out)[K], const T (*kept)[K] = nullptr) {
  if (c.whole) {
    load_chunk<T, K>(m, row, c.t0, kept == nullptr, out);
    return;
  }
#pragma unroll 1
  for (int k = 0; k < K; ++k) {
    const int64_t t = c.token(k);
    put(out, k, t >= 0 && t < n && (!kept || pick(*kept, k) != T(0)) ? m.load<T>(row, t) : T(0));
  }
}

// The same for a contiguous row of T (the gradient), and its store: one 16-byte access for a whole chunk (the row
// pointer is then on the chunk's boundary: the caller checks it into `whole`).
template <typename T, int K>
__device__ __forceinline__ void load_row_tokens(const T* x, int64_t n, const TokenChunk& c, T (&out)[K]) {
  if (c.whole) {
    const Pack<T, K> p = *reinterpret_cast<const Pack<T, K>*>(x + c.t0);
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = p.v[k];
    return;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t t = c.token(k);
    out[k] = t >= 0 && t < n ? x[t] : T(0);
  }
}

template <typename T, int K>
__device__ __forceinline__ void store_row_tokens(T* x, int64_t n, const TokenChunk& c, const T (&v)[K]) {
  if (c.whole) {
    Pack<T, K> p;
#pragma unroll
    for (int k = 0; k < K; ++k) p.v[k] = v[k];
    *reinterpret_cast<Pack<T, K>*>(x + c.t0) = p;
    return;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t t = c.token(k);
    if (t >= 0 && t < n) x[t] = v[k];
  }
}

// f(chunk) for this thread's chunks of a row of n tokens. `vector`: the row allows K-element accesses from token
// `head` on (chunk_head, chunk_aligned); its chunks then start at head + K * c (the first, c = -1, partial when
// head > 0; the last partial when K does not divide n - head).
template <int K, typename F>
__device__ __forceinline__ void for_each_chunk(int64_t n, bool vector, int64_t head, F&& f) {
  if (vector) {
    const int64_t base = head > 0 ? head - K : 0;
    const int64_t chunks = (n - base + K - 1) / K;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const int64_t t0 = base + c * K;
      f(TokenChunk{t0, 1, t0 >= 0 && t0 + K <= n});
    }
  } else {
    for (int64_t t0 = threadIdx.x; t0 < n; t0 += K * int64_t(blockDim.x)) f(TokenChunk{t0, blockDim.x, false});
  }
}

}  // namespace grpo_ext
