// Row walkers of the logits kernels: one block reads (and writes) a contiguous row of V elements with 16-byte vector
// accesses (LDG.E.128 / STG.E.128) in its body and scalar ones in the head (elements before the first 16-byte
// boundary: a row view that starts mid-vector) and the tail (V not a multiple of the vector width). Each thread keeps
// kRowUnroll vectors in flight, so that a block of 1024 threads has 32 KiB of loads outstanding.
//
// Element v of the row goes to exactly one thread, always the same one for the same (row start % 16, V, blockDim):
// the per-thread order of the online softmax is fixed, so results are deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cluster.cuh"  // async_copy_16

// nvcc's device pass, where inline PTX may be used: tests/cuda_emu defines __CUDA_ARCH__ for its CPU build too.
#if defined(__CUDA_ARCH__) && defined(__CUDACC__)
#define GRPO_NVCC_DEVICE_PASS 1
#else
#define GRPO_NVCC_DEVICE_PASS 0
#endif

namespace grpo_ext {

template <typename T, typename In>
__device__ __forceinline__ T load_as(const In* p) {
  return static_cast<T>(*p);
}
template <>
__device__ __forceinline__ float load_as<float, __nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <>
__device__ __forceinline__ float load_as<float, __half>(const __half* p) {
  return __half2float(*p);
}

// The gradient in the logits' dtype, rounded once (to nearest even).
template <typename Out, typename T>
__device__ __forceinline__ Out to_out(T v) {
  return static_cast<Out>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to_out<__half, float>(float v) {
  return __float2half_rn(v);
}

constexpr int kVectorBytes = 16;
// Vectors in flight per thread: 2, except for float64 rows, whose backward spilled at 2 under the 64 registers that
// __launch_bounds__(1024) leaves (float64 is the reference dtype, not a timed one).
template <typename In>
constexpr int kRowUnroll = sizeof(In) == 8 ? 1 : 2;

// kVectorBytes of consecutive elements, moved as one access.
template <typename In>
struct alignas(kVectorBytes) Vector {
  static constexpr int kWidth = kVectorBytes / static_cast<int>(sizeof(In));
  In v[kWidth];
};

// Elements before the first 16-byte boundary of a row starting at `x` (at most n).
template <typename In>
__device__ __forceinline__ int64_t vector_head(const In* x, int64_t n) {
  const int64_t head =
      int64_t((kVectorBytes - (reinterpret_cast<uintptr_t>(x) % kVectorBytes)) % kVectorBytes) / int64_t(sizeof(In));
  return head < n ? head : n;
}

// g(i, vector i) for every vector of body[0, vectors), U vectors per thread loaded before any is used.
template <typename In, int U = kRowUnroll<In>, typename G>
__device__ __forceinline__ void for_each_vector(const Vector<In>* body, int64_t vectors, G&& g) {
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (U - 1) * step < vectors; i += U * step) {
    Vector<In> in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) in[u] = body[i + u * step];
#pragma unroll
    for (int u = 0; u < U; ++u) g(i + u * step, in[u]);
  }
  for (; i < vectors; i += step) {
    const Vector<In> in = body[i];  // one load, whatever g does with it (a reference could be re-read)
    g(i, in);
  }
}

// The largest of a vector's elements as T (NaN passed over, as fmax does): packed max instructions for 16-bit
// types, two elements per instruction, before any conversion.
template <typename T, typename In>
__device__ __forceinline__ T vector_max(const Vector<In>& in) {
  T top = load_as<T>(&in.v[0]);
#pragma unroll
  for (int k = 1; k < Vector<In>::kWidth; ++k) top = fmax(top, load_as<T>(&in.v[k]));
  return top;
}
template <>
__device__ __forceinline__ float vector_max<float, __nv_bfloat16>(const Vector<__nv_bfloat16>& in) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(in.v);
  const __nv_bfloat162 top = __hmax2(__hmax2(pairs[0], pairs[1]), __hmax2(pairs[2], pairs[3]));
  return fmaxf(__low2float(top), __high2float(top));
}
template <>
__device__ __forceinline__ float vector_max<float, __half>(const Vector<__half>& in) {
  const __half2* pairs = reinterpret_cast<const __half2*>(in.v);
  const __half2 top = __hmax2(__hmax2(pairs[0], pairs[1]), __hmax2(pairs[2], pairs[3]));
  return fmaxf(__low2float(top), __high2float(top));
}

// Every element of x[0, n), in a fixed order per thread: one(value as T) for each element of the scalar head and
// tail, chunk(vector) for each 16-byte vector of the body (its W elements in order, as stored), so that a softmax
// pass can rescale once per vector instead of once per element.
template <typename T, typename In, typename One, typename Chunk>
__device__ __forceinline__ void for_each_in_row(const In* x, int64_t n, One&& one, Chunk&& chunk) {
  constexpr int W = Vector<In>::kWidth;
  const int64_t head = vector_head(x, n), vectors = (n - head) / W;
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) one(load_as<T>(x + v));
  for_each_vector(reinterpret_cast<const Vector<In>*>(x + head), vectors,
                  [&](int64_t, const Vector<In>& in) { chunk(in); });
  for (int64_t v = head + vectors * W + threadIdx.x; v < n; v += blockDim.x) one(load_as<T>(x + v));
}

// An element's place in its row as transform_row passes it: the first index of its 16-byte vector and its place in
// the vector (0 for the scalar head and tail). It converts to the index; a caller that compares every element with
// one index (the chosen token) takes `index - base` once per vector (the unrolled elements share it) and compares
// it with the constant k, where `v == id` cost a 64-bit add and compare an element, and nvcc branched around the
// rest of the element's work on it (benchmarks/NOTES.md, "The logits loops on the ncu counters").
struct RowIndex {
  int64_t base;
  int k;
  __device__ __forceinline__ operator int64_t() const { return base + k; }
  // `index - base` is the same for a vector's elements: one 64-bit test a vector, a 32-bit compare an element.
  __device__ __forceinline__ bool is(int64_t index) const {
    const int64_t offset = index - base;
    return static_cast<uint64_t>(offset) < 16 && static_cast<int>(offset) == k;
  }
};

// c ? a : b with both a and b computed: a select instruction, never a branch around the work of the arm not taken
// (nvcc had put each element's softmax term behind a branch taken for one element a row: 3 branch instructions an
// element in the gradient loop). In the CPU emulation, a plain conditional.
template <typename T>
__device__ __forceinline__ T select_computed(bool c, T a, T b) {
#if GRPO_NVCC_DEVICE_PASS
  if constexpr (std::is_same_v<T, float>) {
    float r;
    asm("{\n .reg .pred p;\n setp.ne.u32 p, %3, 0;\n selp.f32 %0, %1, %2, p;\n}"
        : "=f"(r)
        : "f"(a), "f"(b), "r"(static_cast<unsigned>(c)));
    return r;
  } else if constexpr (std::is_same_v<T, double>) {
    double r;
    asm("{\n .reg .pred p;\n setp.ne.u32 p, %3, 0;\n selp.f64 %0, %1, %2, p;\n}"
        : "=d"(r)
        : "d"(a), "d"(b), "r"(static_cast<unsigned>(c)));
    return r;
  }
#endif
  return c ? a : b;
}

// out[v] = f(v, x[v] as T) for every element of [0, n): vector loads as for_each_in_row, and vector stores where
// `out` has the same offset from a 16-byte boundary as `x` (the in-place gradient, and any row of a contiguous
// tensor that starts aligned); scalar stores otherwise. `out` may be `x` (each element is read before it is
// overwritten, by the thread that writes it). U: vectors in flight per thread (0: kRowUnroll<In>).
template <typename T, int U = 0, typename In, typename Out, typename F>
__device__ __forceinline__ void transform_row(const In* x, Out* out, int64_t n, F&& f) {
  static_assert(sizeof(In) == sizeof(Out), "the gradient has the logits' element size");
  constexpr int W = Vector<In>::kWidth;
  const int64_t head = vector_head(x, n), vectors = (n - head) / W;
  const bool vector_stores =
      reinterpret_cast<uintptr_t>(x) % kVectorBytes == reinterpret_cast<uintptr_t>(out) % kVectorBytes;
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) {
    out[v] = to_out<Out, T>(f(RowIndex{v, 0}, load_as<T>(x + v)));
  }
  constexpr int kUnroll = U > 0 ? U : kRowUnroll<In>;
  const Vector<In>* body = reinterpret_cast<const Vector<In>*>(x + head);
  const auto result_of = [&](int64_t i, const Vector<In>& in) {
    Vector<Out> result;
#pragma unroll
    for (int k = 0; k < W; ++k) result.v[k] = to_out<Out, T>(f(RowIndex{head + i * W, k}, load_as<T>(&in.v[k])));
    return result;
  };
  // Two loops, not one with the store's kind chosen per vector: the choice inside the loop kept the scalar stores'
  // code (and their memory descriptors, re-made before each store) in the hot loop: 28.6 -> 23.8 static instructions
  // a bf16 element in the single-read gradient loop (benchmarks/NOTES.md, "The gradient loop's store choice").
  if (vector_stores) {
    Vector<Out>* out_body = reinterpret_cast<Vector<Out>*>(out + head);
    for_each_vector<In, kUnroll>(body, vectors,
                                 [&](int64_t i, const Vector<In>& in) { out_body[i] = result_of(i, in); });
  } else {
    for_each_vector<In, kUnroll>(body, vectors, [&](int64_t i, const Vector<In>& in) {
      const Vector<Out> result = result_of(i, in);
#pragma unroll
      for (int k = 0; k < W; ++k) out[head + i * W + k] = result.v[k];
    });
  }
  for (int64_t v = head + vectors * W + threadIdx.x; v < n; v += blockDim.x) {
    out[v] = to_out<Out, T>(f(RowIndex{v, 0}, load_as<T>(x + v)));
  }
}

// Whether this thread is the one transform_row(x, out, n, ...) gives element `index` of [0, n) to: the head's and
// tail's elements go round the block's threads one by one, the body's 16-byte vectors likewise (for_each_vector). A
// value written after the loop by that thread lands after the loop's own write of the element (program order).
template <typename In>
__device__ __forceinline__ bool writes_element(const In* x, int64_t n, int64_t index) {
  constexpr int W = Vector<In>::kWidth;
  const int64_t head = vector_head(x, n), body_end = head + (n - head) / W * W;
  const int64_t turn = index < head ? index : index < body_end ? (index - head) / W : index - body_end;
  return turn % blockDim.x == threadIdx.x;
}

// staged[0, n) = x[0, n) as stored (no conversion), and each element to one (head and tail, as T) or chunk (a
// vector, as stored), in for_each_in_row's order per thread. `staged` (shared memory) must have x's offset from a
// 16-byte boundary. The body's vectors go global -> shared by async_copy_16 (cluster.cuh), every vector of the thread
// in flight at once, and are read back from shared memory by the thread that copied them (so no barrier): loads
// through registers kept 2 vectors a thread in flight, 32 KiB an SM, the likely reason the single-read pass ran at
// 1.4-1.7x the copy on an H200 (benchmarks/NOTES.md, "The small-block layout on an H200").
template <typename T, typename In, typename One, typename Chunk>
__device__ __forceinline__ void stage_row(const In* x, In* staged, int64_t n, One&& one, Chunk&& chunk) {
  constexpr int W = Vector<In>::kWidth;
  const int64_t head = vector_head(x, n), vectors = (n - head) / W;
  const Vector<In>* source = reinterpret_cast<const Vector<In>*>(x + head);
  Vector<In>* body = reinterpret_cast<Vector<In>*>(staged + head);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) async_copy_16(body + i, source + i);
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) {  // while the body's copies are in flight
    const In value = x[v];
    staged[v] = value;
    one(load_as<T>(&value));
  }
  async_copy_wait_all();
  for_each_vector(static_cast<const Vector<In>*>(body), vectors, [&](int64_t, const Vector<In>& in) { chunk(in); });
  for (int64_t v = head + vectors * W + threadIdx.x; v < n; v += blockDim.x) {
    const In value = x[v];
    staged[v] = value;
    one(load_as<T>(&value));
  }
}

// out[0, n) = value, with 16-byte stores in the body.
template <typename Out>
__device__ __forceinline__ void fill_row(Out* out, int64_t n, Out value) {
  constexpr int W = Vector<Out>::kWidth;
  const int64_t head = vector_head(out, n), vectors = (n - head) / W;
  Vector<Out> fill;
#pragma unroll
  for (int k = 0; k < W; ++k) fill.v[k] = value;
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) out[v] = value;
  Vector<Out>* body = reinterpret_cast<Vector<Out>*>(out + head);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) body[i] = fill;
  for (int64_t v = head + vectors * W + threadIdx.x; v < n; v += blockDim.x) out[v] = value;
}

// Threads per block for a row of `vocab` elements of `element_bytes`: two vectors per thread, 32 to 1024 threads.
inline int row_threads(int64_t vocab, int element_bytes) {
  const int64_t per_thread = 2 * (kVectorBytes / element_bytes);
  const int64_t want = (vocab + per_thread - 1) / per_thread;
  const int64_t clamped = want < 32 ? 32 : (want > 1024 ? 1024 : want);
  return static_cast<int>(((clamped + 31) / 32) * 32);
}

}  // namespace grpo_ext
