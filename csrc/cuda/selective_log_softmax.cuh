// CUDA kernels of selective_log_softmax (docs/math.md section 2), on raw pointers and a stream (no torch types).
// Forward: one block per row reads the row once, keeping an online (max, sum of exp, sum of exp * (z - max)) per
// thread, merged over the block in a fixed order. Backward: one block per row recomputes the softmax from the saved
// logsumexp and writes the gradient.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <limits>
#include <type_traits>

#include "../common.h"
#include "../logit_transform.h"
#include "launch.cuh"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace grpo_ext {

// Online softmax statistics relative to `max`: sum = sum_v exp(z_v - max), weighted = sum_v exp(z_v - max) *
// (z_v - max). Relative to the max, not sum e * z: with |z| ~ 30 the latter loses ~1e-6 absolute to rounding in
// entropy = log(sum) - weighted / sum, which is most of a confident token's entropy.
template <typename T>
struct SoftmaxState {
  T max, sum, weighted;
};

// exp(d) for d <= 0 (or NaN) in the softmax passes. float: one multiply and the SFU's exp2 (MUFU.EX2) with
// subnormal results flushed to 0 (ex2.approx.ftz), within 2 + 1.2|d| ulp and 0 below about -87.3; the library's expf
// is about 8 instructions. The terms it is off on are those far below the max, whose share of a row's sums is as small
// as that error. __expf is the same multiply and exp2, but without -ftz nvcc wraps each exp2 in a range test and two
// multiplies to make the subnormal results of d in [-103, -87.3] (5 instructions an element, not 2; benchmarks/
// NOTES.md, "The logits loops on the ncu counters"): values below 1.2e-38 that no row sum or gradient can tell.
// In the CPU emulation (tests/cuda_emu), __expf.
constexpr float kLog2e = 1.44269504088896341f;  // exp(d) = exp2(d * log2(e)): the SFU has exp2

template <typename T>
__device__ __forceinline__ T softmax_exp(T d) {
  return exp(d);
}
template <>
__device__ __forceinline__ float softmax_exp<float>(float d) {
#if GRPO_NVCC_DEVICE_PASS
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(d * kLog2e));
  return e;
#else
  return __expf(d);
#endif
}

// exp(d - shift) for d - shift <= 0 (or NaN), `shift` the same for a whole row (the gradient loop's log of the row's
// sum): float as the SFU's exp2 of one FFMA, d * log2(e) + c with c = -shift * log2(e) rounded once a row, where
// softmax_exp(d - shift) took a subtraction and a multiply an element. c's rounding is at most half an ulp of
// shift * log2(e) (shift <= log V, so about 1e-6), the size of the subtraction's rounding it replaces. In the CPU
// emulation, softmax_exp(d - shift).
template <typename T>
struct ShiftedExp {
  T shift, offset;
  __device__ __forceinline__ explicit ShiftedExp(T s) : shift(s), offset(-s * T(kLog2e)) {}
  __device__ __forceinline__ T operator()(T d) const {
#if GRPO_NVCC_DEVICE_PASS
    if constexpr (std::is_same_v<T, float>) {
      float e;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(fmaf(d, kLog2e, offset)));
      return e;
    }
#endif
    return softmax_exp(d - shift);
  }
};

template <typename T>
__device__ __forceinline__ SoftmaxState<T> merge_states(SoftmaxState<T> a, SoftmaxState<T> b) {
  if (b.sum == T(0)) return a;  // an empty state (no finite logit yet)
  if (a.sum == T(0)) return b;
  const T m = a.max > b.max ? a.max : b.max;
  const T ea = softmax_exp(a.max - m), eb = softmax_exp(b.max - m);  // both <= 0; one is exp(0) = 1 exactly
  // Re-base each side's weighted sum on the new max: sum e * (z - m) = weighted + sum * (old_max - m).
  return {m, a.sum * ea + b.sum * eb,
          (a.weighted + a.sum * (a.max - m)) * ea + (b.weighted + b.sum * (b.max - m)) * eb};
}

// One raw logit into the state, under f with the cap code kCap: its d as LogitTransform::d_with takes it (one FMA
// without a cap), also where its z becomes the max (its own term is then exp of the product's rounding error, as
// every later d of the row sees that max).
template <SoftCap kCap, typename T>
__device__ __forceinline__ SoftmaxState<T> add_logit(SoftmaxState<T> s, const LogitTransform<T>& f, T logit) {
  const T z = f.template z_with<kCap>(logit);
  if (z == -INFINITY) return s;      // exp(-inf) adds nothing (a NaN goes on and makes the row NaN)
  if (s.sum == T(0) || z > s.max) {  // z becomes the max
    const T d = f.template d_with<kCap>(logit, z), e = softmax_exp(d);
    if (s.sum == T(0)) return {z, e, e * d};
    const T scale = softmax_exp(s.max - z);
    return {z, s.sum * scale + e, (s.weighted + s.sum * (s.max - z)) * scale + e * d};
  }
  const T d = f.template d_with<kCap>(logit, s.max), e = softmax_exp(d);
  return {s.max, s.sum + e, s.weighted + e * d};
}

// add_logit over a vector's raw logits under f with one max update for the vector (its max first: z is increasing
// in the logit, so that is the z of the largest stored value), not one branch per element; each d as d_with takes
// it. The same state up to rounding, and the same special values: a -inf adds nothing (its e * d is e * lowest = 0,
// never 0 * -inf), a NaN or +inf reaches sum as NaN (d = NaN there) and so the row's results.
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ SoftmaxState<T> add_logits(SoftmaxState<T> s, const Vector<In>& in,
                                                      const LogitTransform<T>& f) {
  const T top = f.template z_with<kCap>(vector_max<T>(in));  // a NaN is passed over here, and caught by its d below
  if (top > s.max || (s.sum == T(0) && top > -INFINITY)) {
    if (s.sum == T(0)) {  // the first finite values (the empty state's max 0 means nothing)
      s.max = top;
    } else {  // top becomes the max: re-base the sums on it (top = +inf makes weighted NaN: the row is NaN)
      const T shift = s.max - top, scale = softmax_exp(shift);
      s.weighted = (s.weighted + s.sum * shift) * scale;
      s.sum *= scale;
      s.max = top;
    }
  }
#pragma unroll
  for (int k = 0; k < Vector<In>::kWidth; ++k) {
    const T d = f.template d_with<kCap>(load_as<T>(&in.v[k]), s.max), e = softmax_exp(d);
    s.sum += e;
    s.weighted += e * fmax(d, std::numeric_limits<T>::lowest());
  }
  return s;
}

// This thread's softmax state of a contiguous row x[0, n): add_logit over the scalar head and tail, add_logits over
// each 16-byte vector (for_each_in_row); z from f with the cap code kCap.
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ SoftmaxState<T> row_state(const LogitTransform<T>& f, const In* x, int64_t n) {
  SoftmaxState<T> s{T(0), T(0), T(0)};
  for_each_in_row<T>(
      x, n, [&](T logit) { s = add_logit<kCap>(s, f, logit); },
      [&](const auto& chunk) { s = add_logits<kCap>(s, chunk, f); });
  return s;
}

template <typename T>
__device__ __forceinline__ SoftmaxState<T> warp_merge(SoftmaxState<T> s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    SoftmaxState<T> other{__shfl_down_sync(kFullWarp, s.max, offset), __shfl_down_sync(kFullWarp, s.sum, offset),
                          __shfl_down_sync(kFullWarp, s.weighted, offset)};
    s = merge_states(s, other);
  }
  return s;
}

// Merges every thread's state over the block (blockDim.x a multiple of 32) in a fixed order; the merged state is
// returned to thread 0 (other threads get partial states). `warp_states` is 32 entries of shared memory.
template <typename T>
__device__ __forceinline__ SoftmaxState<T> block_merge(SoftmaxState<T> s, SoftmaxState<T>* warp_states) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  s = warp_merge(s);
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < num_warps ? warp_states[lane] : SoftmaxState<T>{T(0), T(0), T(0)};
    s = warp_merge(s);
  }
  return s;
}

// Up to 1024 threads per block (row_threads); the bound keeps every instantiation launchable at that size, and its 2
// blocks an SM hold each at 32 registers: 100% occupancy at 1024 threads. Without it nvcc gave the soft-capped
// bf16/fp16 forward 41-43 registers on sm_90 once softmax_exp lost its fix-up code (50% occupancy), while the float32
// soft-capped one spilled at 32; with it neither spills, and only float64 (never timed) does, 288 B on sm_90
// (benchmarks/KERNELS.md). `In` is the logits' element type: a row with unit stride is read with 16-byte loads
// (vector_io.cuh). kCap: the soft-cap code compiled in (with_soft_cap).
template <typename T, typename In, SoftCap kCap>
__global__ void __launch_bounds__(1024, 2)
    selective_log_softmax_forward_kernel(StridedMatrix logits, StridedMatrix ids, int64_t rows, int64_t vocab,
                                         LogitTransform<T> f, T* __restrict__ logps, T* __restrict__ entropy,
                                         T* __restrict__ row_stats) {
  __shared__ SoftmaxState<T> warp_states[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    SoftmaxState<T> s{T(0), T(0), T(0)};
    if (logits.col_stride == 1) {
      s = row_state<kCap>(f, static_cast<const In*>(logits.data) + row * logits.row_stride, vocab);
    } else {
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
        s = add_logit<kCap>(s, f, logits.load<T>(row, v));
      }
    }
    s = block_merge(s, warp_states);
    if (threadIdx.x == 0) {
      const int64_t id = ids.load<int64_t>(row, 0);
      CUDA_KERNEL_ASSERT(id >= 0 && id < vocab);
      // (z_id - max) - log(sum), not z_id - lse: rounding lse (~30) costs ~2e-6 absolute, all of a confident
      // token's log-prob (~-1e-6).
      const T log_sum = log(s.sum), mean_shift = s.weighted / s.sum;
      logps[row] = f.template d_with<kCap>(logits.load<T>(row, id), s.max) - log_sum;
      if (entropy) entropy[row] = log_sum - mean_shift;
      // relative to the max (kSoftmaxStats): the backward takes each d as the FMA above, not z - lse
      row_stats[kSoftmaxStats * row] = s.max + (log_sum - log_sum);  // NaN for a NaN row, as on the CPU
      row_stats[kSoftmaxStats * row + 1] = log_sum;
      row_stats[kSoftmaxStats * row + 2] = mean_shift;
    }
    __syncthreads();  // warp_states is reused by the next row
  }
}

// kCap as in the forward. Two float blocks an SM (32 registers): without the bound, the third row statistic took
// sm_80's float32 build from 32 registers to 54 (half the occupancy); with it no float32/bf16/fp16 build spills, but
// for 4 B on sm_100's capped float32 one (benchmarks/KERNELS.md; sm_86/sm_89/sm_120 SMs cannot hold two such
// blocks). float64 keeps one block an SM: at 32 registers it spilled 140 B on sm_90.
template <typename T, typename Out, SoftCap kCap>
__global__ void __launch_bounds__(1024, sizeof(T) == 4 ? 2 : 1)
    selective_log_softmax_backward_kernel(StridedMatrix logits, StridedMatrix ids, StridedMatrix grad_logps,
                                          StridedMatrix grad_entropy, const T* __restrict__ row_stats, int64_t rows,
                                          int64_t vocab, LogitTransform<T> f, Out* __restrict__ grad_logits) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T z_max = row_stats[kSoftmaxStats * row], log_sum = row_stats[kSoftmaxStats * row + 1];
    const T mean_shift = row_stats[kSoftmaxStats * row + 2];
    const T gl = grad_logps.load<T>(row, 0);
    const T gh = grad_entropy.present() ? grad_entropy.load<T>(row, 0) : T(0);
    const int64_t id = ids.load<int64_t>(row, 0);
    Out* out = grad_logits + row * vocab;
    // No upstream gradient: exactly 0 whatever the row holds (never 0 * NaN), and the row is not read. A branch per
    // row, not a select per element: the select took the bf16 loop from 32 registers to 50 (half the occupancy).
    const bool inert = gl == T(0) && gh == T(0);
    if (inert) {
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) out[v] = to_out<Out, T>(T(0));
      continue;
    }
    // v: a RowIndex (vector_io.cuh), so that the chosen-token test is one 64-bit compare a vector, not one an element
    const auto grad = [&](RowIndex v, T logit) {
      // d = z - max as the forward's log-prob took it (one FMA without a cap): exact near the max, where z - lse
      // with lse rounded to T cost an ulp of |z| (1e-3 at z = 1e4)
      const T d = f.template d_with<kCap>(logit, z_max);
      const T p = softmax_exp(d - log_sum);
      const T onehot = select_computed(v.is(id), gl, T(0));
      const T spread = p > T(0) ? p * (d - mean_shift) : T(0);  // a -inf logit: p = 0, and not 0 * -inf
      return (onehot - gl * p - gh * spread) * f.template slope_with<kCap>(f.template z_with<kCap>(logit));
    };
    if (logits.col_stride == 1) {  // the logits' dtype is Out's (the binding's dispatch)
      // bf16/fp16: one vector in flight (32 registers, 100% occupancy at 1024 threads; two took 52 and 50%): the
      // same 32 KiB of loads in flight per SM, twice the warps to hide latency.
      constexpr int kVectorsInFlight = sizeof(Out) == 2 ? 1 : kRowUnroll<Out>;
      transform_row<T, kVectorsInFlight>(static_cast<const Out*>(logits.data) + row * logits.row_stride, out, vocab,
                                         grad);
    } else {
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
        out[v] = to_out<Out, T>(grad(RowIndex{v, 0}, logits.load<T>(row, v)));
    }
  }
}

template <typename T>
void launch_selective_log_softmax_forward(const StridedMatrix& logits, const StridedMatrix& ids, int64_t rows,
                                          int64_t vocab, const LogitTransform<T>& f, T* logps, T* entropy, T* row_stats,
                                          cudaStream_t stream) {
  if (rows == 0) return;
  const int64_t max_blocks = int64_t(1) << 30;
  const unsigned blocks = static_cast<unsigned>(rows < max_blocks ? rows : max_blocks);
  const auto launch = [&](auto element) {  // the kernel for the logits' element type and the cap
    using In = decltype(element);
    with_soft_cap(f, [&](auto cap) {
      GRPO_LAUNCH(blocks, row_threads(vocab, sizeof(In)), 0, stream,
                  selective_log_softmax_forward_kernel<T, In, decltype(cap)::value>)(logits, ids, rows, vocab, f, logps,
                                                                                     entropy, row_stats);
    });
  };
  if constexpr (std::is_same_v<T, double>) {  // float64 logits (the only ones accumulated in float64)
    launch(double());
  } else if (logits.dtype == DType::kBFloat16) {
    launch(__nv_bfloat16());
  } else if (logits.dtype == DType::kFloat16) {
    launch(__half());
  } else {
    launch(float());
  }
}

template <typename T, typename Out>
void launch_selective_log_softmax_backward(const StridedMatrix& logits, const StridedMatrix& ids,
                                           const StridedMatrix& grad_logps, const StridedMatrix& grad_entropy,
                                           const T* row_stats, int64_t rows, int64_t vocab, const LogitTransform<T>& f,
                                           Out* grad_logits, cudaStream_t stream) {
  if (rows == 0) return;
  const int64_t max_blocks = int64_t(1) << 30;
  const unsigned blocks = static_cast<unsigned>(rows < max_blocks ? rows : max_blocks);
  with_soft_cap(f, [&](auto cap) {
    GRPO_LAUNCH(blocks, row_threads(vocab, sizeof(Out)), 0, stream,
                selective_log_softmax_backward_kernel<T, Out, decltype(cap)::value>)(
        logits, ids, grad_logps, grad_entropy, row_stats, rows, vocab, f, grad_logits);
  });
}

}  // namespace grpo_ext
