// CUDA kernels of the fused GRPO loss from logits, on raw pointers and a stream (no torch types).
//
// Token-level losses: a small one-block kernel turns the masks into per-row gradient weights (no host sync), then
// the pass computes each row's online softmax statistics (16-byte loads, vector_io.cuh), the token's log-prob,
// entropy and d loss / d logp (grpo_loss_math.h), and writes the gradient g * (onehot - softmax) * dz/dx (docs/math.md
// section 2: temperature, logit_scale, logit_softcap). Two kernels share that per-row code (finish_row,
// write_row_grad): the single-read one, for rows that fit on chip, stages each row in shared memory, split over a
// thread-block cluster when one block cannot hold it (cluster.cuh), and reads HBM once; the two-read one, for any
// row, reads it again to write the gradient (from L2 while the row is still there). The logits never round-trip
// through an [N, V] float temporary. Sequence-level losses run the pass twice: for the log-probs, then with the
// per-token gradients. (One file past 300 lines: both kernels and their one launcher belong to this op.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "../logits_loss_math.h"
#include "cluster.cuh"
#include "launch.cuh"
#include "reduce.cuh"
#include "selective_log_softmax.cuh"
#include "vector_io.cuh"

namespace grpo_ext {

// row_weight[b] = global scale * (1 / max(n_b, 1) for grpo/sapo, else 1), and row_weight[B] = the entropy bonus'
// entropy_coef * loss_scale / max(sum m * w, 1) (w: entropy_weights, 1 when absent). One block: a warp per row for
// n_b (a fixed shuffle tree), then a fixed block tree over the rows for the mask totals. The totals, the scale and
// each weight in double, rounded to T once, as the CPU kernel does.
template <typename T>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_row_weights_kernel(LossParams p, LossInputs in, int64_t max_completion_length,
                                             bool has_num_items, T num_items_value,
                                             const T* __restrict__ num_items_device, T loss_scale, T entropy_coef,
                                             StridedMatrix entropy_weights, T* __restrict__ row_weight) {
  __shared__ double scratch[3 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  double weighted = 0.0;  // this thread's part of sum m * w (only with entropy_weights): tokens of many rows
  for (int64_t b = warp; b < in.batch; b += num_warps) {
    T count = T(0);
    for (int64_t t = lane; t < in.seq_len; t += 32) {
      const T m = in.mask_at<T>(b, t);
      count += m;
      if (entropy_weights.present()) weighted += double(m * entropy_weights.load<T>(b, t));
    }
    count = warp_sum(count);
    if (lane == 0) row_weight[b] = count;
  }
  __syncthreads();                         // the counts are visible to the whole block
  double total[3] = {0.0, 0.0, weighted};  // the kept tokens, the rows with one, sum m * w
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    total[0] += row_weight[b];
    total[1] += row_weight[b] > T(0) ? 1.0 : 0.0;
  }
  block_sum<double, 3>(total, scratch);
  const double num_items = num_items_device ? double(num_items_device[0]) : double(num_items_value);
  const double scale = global_loss_scale<double>(p, in.batch, max_completion_length, total[0], total[1], has_num_items,
                                                 num_items, double(loss_scale));
  if (threadIdx.x == 0) {  // before the rows' loop: so ordered, the float kernel fits 32 registers, no spill
    row_weight[in.batch] = T(entropy_row_weight<double>(double(entropy_coef), double(loss_scale),
                                                        entropy_weights.present() ? total[2] : total[0]));
  }
  for (int64_t b = threadIdx.x; b < in.batch; b += blockDim.x) {
    row_weight[b] = T(logits_row_weight<double>(p.loss_type, double(row_weight[b]), scale));
  }
}

struct LogitsPassArgs {
  LossParams params;
  LossInputs inputs;  // the [B, T] loss inputs; logps unused
  LogitsRows logits;
  StridedMatrix ids;         // [R, 1]
  StridedMatrix token_grad;  // [R, 1] or absent
  int64_t row_offset;
  bool compute_grad;
  bool grad_in_logits;            // the in-place op: row r's gradient goes over logits row r
  bool entropy_bonus;             // the gradient has the entropy bonus' term (its weight is row_weight[B])
  StridedMatrix entropy_weights;  // [B, T] weights of the tokens in the bonus' mean, or absent (every kept token)
};

// The shared memory of both pass kernels' per-row work.
template <typename T>
struct PassShared {
  SoftmaxState<T> warp_states[32];
  T row_max, row_log_sum, row_logp, row_g;
  T row_entropy_weight, row_mean_shift;  // the entropy bonus' e * m and E_p[z] - max
  int64_t row_id;
};

// A logits row's place in the loss: its output index r, its token (b, t) and that token's mask value m.
template <typename T>
struct PassRow {
  int64_t r, b, t;
  T m;
};

template <typename T>
__device__ __forceinline__ PassRow<T> pass_row(const LogitsPassArgs& a, int64_t r) {
  const int64_t n = a.row_offset + r, b = n / a.inputs.seq_len, t = n % a.inputs.seq_len;
  return {r, b, t, a.inputs.mask_at<T>(b, t)};
}

// The row's chosen token and its transformed logit, read by thread 0 before any block writes over the row (the
// in-place op).
template <typename T>
struct ChosenToken {
  int64_t id;
  T z;
};

template <typename T, typename In>
__device__ __forceinline__ ChosenToken<T> chosen_token(const LogitsPassArgs& a, const LogitTransform<T>& f, const In* x,
                                                       int64_t r) {
  const int64_t id = a.ids.load<int64_t>(r, 0);
  CUDA_KERNEL_ASSERT(id >= 0 && id < a.logits.vocab);
  return {id, f(load_as<T>(x + id))};
}

// Thread 0 of a block, once the row's softmax state `s` is known: the log-prob, the entropy (written when
// `write_outputs`) and d loss / d logp, shared with the block for the gradient.
template <typename T>
__device__ __forceinline__ void finish_row(const LogitsPassArgs& a, const T* row_weight, const ChosenToken<T>& chosen,
                                           const SoftmaxState<T>& s, const PassRow<T>& row, bool with_grad,
                                           bool write_outputs, T* logps, T* entropy, PassShared<T>& sh) {
  const LossParams& p = a.params;
  const LossInputs& in = a.inputs;
  // Relative to the max (see selective_log_softmax_forward_kernel): exact for confident tokens.
  const T log_sum = log(s.sum);
  const T logp = (chosen.z - s.max) - log_sum;
  if (write_outputs) {
    logps[row.r] = logp;
    entropy[row.r] = log_sum - s.weighted / s.sum;
  }
  T g = T(0);
  if (with_grad) {
    if (a.token_grad.present()) {
      g = a.token_grad.load<T>(row.r, 0);
    } else {
      const T l_old = p.has_old ? in.old_logps.load<T>(row.b, row.t) : logp;
      const T l_ref = p.beta != 0.0 ? in.ref_logps.load<T>(row.b, row.t) : T(0);
      const T isw = (in.is_weights.present() ? in.is_weights.load<T>(row.b, row.t) : T(1)) *
                    (in.policy_weights.present() ? in.policy_weights.load<T>(row.b, row.t) : T(1));
      g = row_weight[row.b] * row.m *
          token_logp_grad<T>(TokenConsts<T>(p), policy_family(p.loss_type), kl_kind(p), p.bias_correction, p.has_old,
                             logp, l_old, l_ref, in.advantages.load<T>(row.b, row.t), isw);
    }
  }
  sh.row_max = s.max;
  sh.row_log_sum = log_sum;
  sh.row_logp = logp;
  sh.row_g = g;
  T entropy_weight = T(0);
  if (with_grad && a.entropy_bonus) {
    entropy_weight = row_weight[in.batch] * row.m;
    if (a.entropy_weights.present()) entropy_weight *= a.entropy_weights.load<T>(row.b, row.t);
  }
  sh.row_entropy_weight = entropy_weight;
  sh.row_mean_shift = s.weighted / s.sum;
  sh.row_id = chosen.id;
}

// out[v] = d/dx_v of g * logp for the row's elements [lo, lo + n) read from `x` (the row at `x - lo`):
// g * (onehot - p_v) * dz/dx, the chosen entry as -g * expm1(logp) (exact where p -> 1); with the entropy bonus, plus
// e * p_v * (z_v - E_p[z]) (0 where p_v = 0, a -inf logit included).
template <SoftCap kCap, bool kEntropy, typename T, typename In>
__device__ __forceinline__ void write_row_grad_with(const LogitTransform<T>& f, const PassShared<T>& sh, const In* x,
                                                    In* out, int64_t lo, int64_t n) {
  const T z_max = sh.row_max, log_sum = sh.row_log_sum, g = sh.row_g;
  const T e = sh.row_entropy_weight, mean_shift = sh.row_mean_shift;
  const int64_t id = sh.row_id - lo;
  const T chosen = -g * expm1(sh.row_logp);
  transform_row<T>(x, out, n, [&](RowIndex v, T logit) {
    const T z = f.template z_with<kCap>(logit), d = z - z_max;
    const T p = softmax_exp(d - log_sum);
    T value = select_computed(v.is(id), chosen, -g * p);
    // p * (d - E_p[z] + max) with no branch: where p = 0 (a -inf logit, d = -inf) d is taken as the lowest float,
    // so the term is 0 * finite = 0, never 0 * -inf; a NaN p stays NaN.
    if constexpr (kEntropy) value += e * p * (fmax(d, std::numeric_limits<T>::lowest()) - mean_shift);
    return value * f.template slope_with<kCap>(z);
  });
}
// The row's gradient loop with the entropy bonus' term compiled in only where the row has one (a uniform branch).
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ void write_row_grad(const LogitTransform<T>& f, const PassShared<T>& sh, const In* x,
                                               In* out, int64_t lo, int64_t n) {
  if (sh.row_entropy_weight != T(0)) {
    write_row_grad_with<kCap, true>(f, sh, x, out, lo, n);
  } else {
    write_row_grad_with<kCap, false>(f, sh, x, out, lo, n);
  }
}

// row_state (selective_log_softmax.cuh) while staging the part x[0, n) in shared memory (single-read pass).
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ SoftmaxState<T> staged_row_state(const LogitTransform<T>& f, const In* x, In* staged,
                                                            int64_t n) {
  SoftmaxState<T> s{T(0), T(0), T(0)};
  const auto z_of = [&](T logit) { return f.template z_with<kCap>(logit); };
  stage_row<T>(
      x, staged, n, [&](T logit) { s = add_logit(s, z_of(logit)); },
      [&](const auto& chunk) { s = add_logits(s, chunk, z_of); });
  return s;
}

// The two-read pass, for any row: up to 1024 threads per block (row_threads); the bound keeps even the float64
// instantiation within the SM's 64K registers, where it would otherwise fail to launch.
template <typename T, typename In>
__global__ void __launch_bounds__(1024)
    grpo_loss_from_logits_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight, In* grad,
                                 T* __restrict__ logps, T* __restrict__ entropy) {
  __shared__ PassShared<T> sh;
  const int64_t vocab = a.logits.vocab;
  for (int64_t r = blockIdx.x; r < a.logits.rows; r += gridDim.x) {
    const PassRow<T> row = pass_row<T>(a, r);
    const In* x = static_cast<const In*>(a.logits.data) + a.logits.offset(r);
    // Not __restrict__: in the in-place op this is x itself (each element is read before it is overwritten, by
    // the thread that writes it).
    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + a.logits.offset(r) : grad + r * vocab) : nullptr;
    if (row.m == T(0)) {  // never read; a zero gradient
      if (grad_row) fill_row(grad_row, vocab, to_out<In, T>(T(0)));
      if (threadIdx.x == 0) {
        logps[r] = T(0);
        entropy[r] = T(0);
      }
      continue;
    }
    SoftmaxState<T> s;
    with_soft_cap(f, [&](auto cap) { s = row_state<decltype(cap)::value>(f, x, vocab); });
    s = block_merge(s, sh.warp_states);
    if (threadIdx.x == 0) {
      finish_row(a, row_weight, chosen_token(a, f, x, r), s, row, grad_row != nullptr, true, logps, entropy, sh);
    }
    __syncthreads();
    // The second read of the row, from L2 if it is still there.
    if (grad_row)
      with_soft_cap(f, [&](auto cap) { write_row_grad<decltype(cap)::value>(f, sh, x, grad_row, 0, vocab); });
    __syncthreads();  // the shared row values are reused by the next row
  }
}

// What each block of a row's cluster pushes to every block of it (the single-read pass): its part's softmax state,
// and from the block whose part holds the row's chosen token, that token's transformed logit (0 from the others).
template <typename T>
struct alignas(16) PartState {
  SoftmaxState<T> state;
  T chosen_z;
};

constexpr unsigned kMaxClusterBlocks = 16;  // CUDA's largest (non-portable) cluster

// The single-read kernel's shared memory (one declaration, so that the host knows its size: split_row): the per-row
// work's, and the inbox the cluster's blocks push their parts' states into, by row parity and sender rank, with
// the mbarrier of each parity's slot (its phase completes when every block's state has landed).
template <typename T>
struct SingleReadShared {
  PassShared<T> pass;
  PartState<T> inbox[2][kMaxClusterBlocks];
  Mbarrier inbox_full[2];
};

// The single-read pass, for rows that fit on chip: a row is split into `slice`-element parts (a multiple of the
// vector width, so that each part starts at the row's offset from a 16-byte boundary), one per block of a cluster
// (cluster_num_blocks() blocks, one cluster per row; a single block where the row fits one block's shared memory).
// Each block copies its part into dynamic shared memory (cp.async: the whole part in flight at once) and accumulates
// the part's softmax state from there; warp 0 of each block pushes that state into every block's inbox
// (cluster_push: st.async into distributed shared memory, counted on the receiver's mbarrier), waits for the
// cluster's states to land in its own inbox, and merges them in the same fixed order in every block (the same bits
// everywhere); each block then writes its part's gradient from shared memory. HBM sees each row once, and the
// chosen token's logit comes from the staged part that holds it. No cluster barrier per row and none at exit: a
// block receives pushes only for rows it waits on, so nothing lands after it exits, and no block reads a peer's
// shared memory. The small-block kernel runs it (256 threads, clusters of up to 16, several blocks per SM:
// small_block_layout).
template <typename T, typename In>
__device__ __forceinline__ void single_read_pass(const LogitsPassArgs& a, const LogitTransform<T>& f,
                                                 const T* __restrict__ row_weight, In* grad, T* __restrict__ logps,
                                                 T* __restrict__ entropy, int64_t slice, SingleReadShared<T>& sh) {
  In* const staged_base = dynamic_shared<In>();  // slice + one vector of elements
  const unsigned rank = cluster_block_rank(), blocks = cluster_num_blocks();
  CUDA_KERNEL_ASSERT(blocks <= kMaxClusterBlocks);  // the inbox's slots
  const int64_t vocab = a.logits.vocab, lo = rank * slice;
  const int64_t n = lo < vocab ? (vocab - lo < slice ? vocab - lo : slice) : 0;
  if (threadIdx.x == 0) {
    mbarrier_init(&sh.inbox_full[0], 1);  // one arrival a phase: this block's thread 0 announcing the bytes
    mbarrier_init(&sh.inbox_full[1], 1);
  }
  cluster_sync_mbarrier_init();  // no peer pushes before this block's mbarriers exist
  // The row's inbox slot: a fast peer may push the next row's state before this block has read this row's.
  unsigned parity = 0, phases = 0;  // phases: each slot's mbarrier phase parity, bit `parity`
  for (int64_t r = blockIdx.x / blocks; r < a.logits.rows; r += gridDim.x / blocks) {
    const PassRow<T> row = pass_row<T>(a, r);
    const In* x = static_cast<const In*>(a.logits.data) + a.logits.offset(r);
    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + a.logits.offset(r) : grad + r * vocab) : nullptr;
    if (row.m == T(0)) {  // the same branch in every block of the cluster: no block awaits a push that never comes
      if (grad_row) fill_row(grad_row + lo, n, to_out<In, T>(T(0)));
      if (rank == 0 && threadIdx.x == 0) {
        logps[r] = T(0);
        entropy[r] = T(0);
      }
      continue;
    }
    // The part at the same offset from a 16-byte boundary as in global memory: 16-byte copies both ways.
    In* staged = staged_base + (reinterpret_cast<uintptr_t>(x + lo) % kVectorBytes) / sizeof(In);
    SoftmaxState<T> s;
    with_soft_cap(f, [&](auto cap) { s = staged_row_state<decltype(cap)::value>(f, x + lo, staged, n); });
    s = block_merge(s, sh.pass.warp_states);  // the block's state in thread 0; every thread's copy has landed
    if (threadIdx.x < 32) {
      // Warp 0: lane k pushes the block's state (and the chosen token's logit, from the staged part holding it)
      // into block k's inbox, all at once; then every lane waits for the cluster's states to land here.
      const unsigned lane = threadIdx.x;
      const int64_t id = a.ids.load<int64_t>(r, 0);
      CUDA_KERNEL_ASSERT(id >= 0 && id < vocab);
      PartState<T> mine{
          {__shfl_sync(kFullWarp, s.max, 0), __shfl_sync(kFullWarp, s.sum, 0), __shfl_sync(kFullWarp, s.weighted, 0)},
          T(0)};
      if (id >= lo && id < lo + n) mine.chosen_z = f(load_as<T>(staged + (id - lo)));
      Mbarrier* const full = &sh.inbox_full[parity];
      if (lane == 0) mbarrier_arrive_expect_tx(full, blocks * unsigned(sizeof(PartState<T>)));
      if (lane < blocks) cluster_push(&sh.inbox[parity][rank], lane, mine, full);
      mbarrier_wait(full, (phases >> parity) & 1u);
      // Lane k merges rank k's state by warp_merge's fixed shuffle tree, the same in every block: the same bits
      // everywhere.
      const SoftmaxState<T> part = lane < blocks ? sh.inbox[parity][lane].state : SoftmaxState<T>{T(0), T(0), T(0)};
      const SoftmaxState<T> total = warp_merge(part);
      if (lane == 0) {
        const ChosenToken<T> chosen{id, sh.inbox[parity][id / slice].chosen_z};
        finish_row(a, row_weight, chosen, total, row, grad_row != nullptr, rank == 0, logps, entropy, sh.pass);
      }
    }
    phases ^= 1u << parity;
    parity ^= 1u;
    __syncthreads();
    if (grad_row) {
      with_soft_cap(f,
                    [&](auto cap) { write_row_grad<decltype(cap)::value>(f, sh.pass, staged, grad_row + lo, lo, n); });
    }
    __syncthreads();  // the staged part and the shared row values are reused by the next row
  }
}

// The single-read pass's kernel (GRPO_EXT_LOGITS_SINGLE_READ=1): blocks of at most kSmallBlockThreads threads,
// kSmallBlocksPerSm of them per SM. The bound caps the registers at 65536 / (256 * 4) = 64 a thread, within which the
// pass fits (0 spills for float32, bf16 and fp16 logits on sm_90: benchmarks/KERNELS.md), so that four blocks, of four
// different rows, share an SM and one's loads run while another merges, finishes or writes.
constexpr int kSmallBlockThreads = 256;
constexpr unsigned kSmallBlocksPerSm = 4;

template <typename T, typename In>
__global__ void __launch_bounds__(256, 4)  // kSmallBlockThreads, kSmallBlocksPerSm (tests/cuda_emu reads numbers)
    grpo_loss_from_logits_small_block_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight,
                                             In* grad, T* __restrict__ logps, T* __restrict__ entropy, int64_t slice) {
  __shared__ SingleReadShared<T> sh;
  single_read_pass(a, f, row_weight, grad, logps, entropy, slice, sh);
}

// What the device offers the single-read pass: dynamic shared memory per block (the device's opt-in maximum) and per
// SM, and the largest cluster (16 on sm_90 and newer: the non-portable size; 1 before; 0: the two-read pass only).
// And the layout on the SM: threads per block of the two-read kernel at most max_threads (0: two_read_threads), and
// whether the single-read kernel's clusters are persistent.
struct RowResidency {
  size_t shared_per_block = 0;
  size_t shared_per_sm = 0;
  unsigned max_cluster_blocks = 0;
  int max_threads = 0;
  bool persistent_clusters = false;  // as many clusters as run at once, each over several rows
};

// The layout candidates of issues 32 and 38, chosen at run time so that one GPU session compares them all (read at
// each call; anything else keeps the default). The default is the two-read kernel for every row: on an H100 and an
// H200 it was faster than every single-read layout measured (2026-11-26/27, benchmarks/RESULTS.md), so the
// single-read pass waits behind GRPO_EXT_LOGITS_SINGLE_READ=1 (or small-blocks, its earlier name) until it wins: the
// small-block layout (small_block_layout: clusters of up to 16 blocks of 256 threads, four blocks of four rows per
// SM) where a row fits, else the two-read kernel. The resident layout (one block of up to 1024 threads an SM, its
// part of the row up to 227 KiB, clusters of up to 8) is gone: it lost to the two-read pass on all five shapes of
// both H100 calls and to the small blocks on every shape of both H200 calls (benchmarks/NOTES.md, "The resident
// single-read kernel removed"). The two-read kernel takes blocks of at most 256 threads for bf16/fp16 logits and 512
// for float32 (two_read_threads; its 55-64 registers a thread allow 1024 threads an SM): on an H200, 512 was 3.5-25%
// faster than one block of 1024 per SM on four of bench_floor's five shapes and level on the fifth, since one block
// of 1024 leaves the SM idle while it finishes a row; 256 was 2-5% faster than 512 on three bf16 shapes, level on
// the fourth, 2.5% slower on float32 (2026-11-27, RESULTS.md, both H200 sections).
// GRPO_EXT_LOGITS_THREADS=128|256|512|1024 sets the two-read kernel's block size, and 128 the small blocks' too.
// GRPO_EXT_LOGITS_PERSISTENT=1 launches the small-block layout with no more clusters than the device runs at once
// (cudaOccupancyMaxActiveClusters), each over several rows: one cluster placed per row was one candidate cause of that
// layout's time on an H200 (benchmarks/NOTES.md, "The small-block layout on an H200").
// The two-read kernel's default block size (above) for logits of `element_bytes`: 256 threads for bf16/fp16, 512 for
// float32 and wider. max_threads == 0 (RowResidency) asks for it.
constexpr int two_read_threads(int element_bytes) {
  return element_bytes <= 2 ? 256 : 512;
}

inline RowResidency with_layout_from_env(RowResidency device) {
  const char* single_read = std::getenv("GRPO_EXT_LOGITS_SINGLE_READ");
  const bool wanted =
      single_read != nullptr && (std::strcmp(single_read, "1") == 0 || std::strcmp(single_read, "small-blocks") == 0);
  if (!wanted) device.max_cluster_blocks = 0;
  if (const char* threads = std::getenv("GRPO_EXT_LOGITS_THREADS")) {
    if (std::strcmp(threads, "128") == 0) device.max_threads = 128;
    if (std::strcmp(threads, "256") == 0) device.max_threads = 256;
    if (std::strcmp(threads, "512") == 0) device.max_threads = 512;
    if (std::strcmp(threads, "1024") == 0) device.max_threads = 1024;
  }
  const char* persistent = std::getenv("GRPO_EXT_LOGITS_PERSISTENT");
  device.persistent_clusters = persistent != nullptr && std::strcmp(persistent, "1") == 0;
  return device;
}

// How the single-read kernel splits a row of `vocab` elements: `cluster_blocks` blocks of `slice` elements each, with
// `shared_bytes` of dynamic shared memory per block; cluster_blocks == 0 when the row does not fit.
struct RowSplit {
  unsigned cluster_blocks = 0;
  int64_t slice = 0;
  size_t shared_bytes = 0;
};

// A row of `vocab` elements in the fewest parts of at most `share` bytes of shared memory each (the kernel's static
// SingleReadShared included), at most max_blocks of them; cluster_blocks == 0 when it does not fit.
template <typename T, typename In>
inline RowSplit split_row(int64_t vocab, int64_t share, unsigned max_blocks) {
  constexpr int64_t width = Vector<In>::kWidth, element = sizeof(In);
  const int64_t free_bytes = share - int64_t(sizeof(SingleReadShared<T>));
  // Elements a block can stage, a multiple of the vector width, leaving room for the alignment pad (one vector).
  const int64_t per_block = (free_bytes / element - width) / width * width;
  if (vocab <= 0 || per_block < width || max_blocks == 0) return {};
  const int64_t blocks = (vocab + per_block - 1) / per_block;
  if (blocks > int64_t(max_blocks)) return {};
  // At most per_block (a multiple of width at least vocab / blocks), so every block's part starts inside the row.
  const int64_t slice = ((vocab + blocks - 1) / blocks + width - 1) / width * width;
  return {static_cast<unsigned>(blocks), slice, size_t((slice + width) * element)};
}

// The small-block layout of a row: `cluster_blocks` blocks (1 to 16) of `threads` threads, `blocks_per_sm` of them
// per SM, each staging a `slice`-element part in `shared_bytes` of dynamic shared memory; cluster_blocks == 0 when
// the row does not fit 16 blocks (the two-read pass then). The one table of the layout, from counts (benchmarks/
// NOTES.md, "The single-read pass in clusters of up to 16 small blocks"):
// - registers: 64 a thread at most (the kernel's launch bounds: 256 threads, 4 blocks), so an SM runs 4 blocks of
//   256 threads;
// - shared memory: an SM's (228 KiB on an H100) over blocks_per_sm blocks, 1 KiB of it reserved per block, less the
//   kernel's static SingleReadShared, and at most the per-block maximum;
// - bytes in flight: a block stages its whole part with cp.async (stage_row), up to ~56 KiB outstanding, so one block
//   alone covers the ~25-50 KiB per SM that Little's law asks (3.0-4.3 TB/s x 1-1.5 us / 132 SMs). Loads through
//   registers (2 vectors a thread: 8 KiB a block, 32 KiB an SM) ran at 1.42-1.63x the copy on an H200, most likely
//   latency-bound (benchmarks/NOTES.md, "The small-block layout on an H200").
// So the most blocks per SM that keep the cluster within 16 (4, else 3, else 2), and then the fewest blocks per row
// (each merge and barrier is per row and block).
struct SmallBlockLayout {
  unsigned cluster_blocks = 0;
  int threads = 0;
  unsigned blocks_per_sm = 0;
  int64_t slice = 0;
  size_t shared_bytes = 0;
};

template <typename T, typename In>
inline SmallBlockLayout small_block_layout(int64_t vocab, const RowResidency& device) {
  constexpr int64_t reserved = 1024;
  if (vocab <= 0 || device.max_cluster_blocks == 0) return {};
  for (unsigned per_sm = kSmallBlocksPerSm; per_sm >= 2; --per_sm) {
    int64_t share = int64_t(device.shared_per_sm / per_sm) - reserved;
    if (share > int64_t(device.shared_per_block)) share = int64_t(device.shared_per_block);
    const RowSplit split = split_row<T, In>(vocab, share, device.max_cluster_blocks);
    if (split.cluster_blocks == 0) continue;
    // kSmallBlockThreads at most, or GRPO_EXT_LOGITS_THREADS=128 (max_threads): twice the elements a thread, half
    // the per-row work a thread repeats (merges, barriers, setup) per element, and half the warps.
    const int cap =
        device.max_threads > 0 && device.max_threads < kSmallBlockThreads ? device.max_threads : kSmallBlockThreads;
    const int threads = row_threads(split.slice, int(sizeof(In)));
    return {split.cluster_blocks, threads < cap ? threads : cap, per_sm, split.slice, split.shared_bytes};
  }
  return {};
}

// x *= factor[0] over the rows of a [R, V] (row-strided) gradient, unless the factor is exactly 1: every block
// reads the factor and returns at once, so a backward with grad_output == 1 costs a launch and no pass over memory.
// One block per row, 16-byte accesses (rows are contiguous).
template <typename T, typename Out>
__global__ void __launch_bounds__(1024) scale_rows_kernel(LogitsRows rows, const T* __restrict__ factor) {
  const T f = factor[0];
  if (f == T(1)) return;
  Out* base = static_cast<Out*>(const_cast<void*>(rows.data));
  for (int64_t r = blockIdx.x; r < rows.rows; r += gridDim.x) {
    Out* row = base + rows.offset(r);
    transform_row<T>(row, row, rows.vocab, [&](int64_t, T v) { return v * f; });
  }
}

template <typename T>
void launch_grpo_loss_from_logits_row_weights(const LossParams& p, const LossInputs& in, int64_t max_completion_length,
                                              bool has_num_items, T num_items_value, const T* num_items_device,
                                              T loss_scale, T entropy_coef, const StridedMatrix& entropy_weights,
                                              T* row_weight, cudaStream_t stream) {
  GRPO_LAUNCH(1, 1024, 0, stream, grpo_loss_from_logits_row_weights_kernel<T>)(
      p, in, max_completion_length, has_num_items, num_items_value, num_items_device, loss_scale, entropy_coef,
      entropy_weights, row_weight);
}

// Threads per block of the two-read kernel: row_threads, at most device.max_threads (two_read_threads when 0).
inline int pass_threads(int64_t vocab, int element_bytes, const RowResidency& device) {
  const int threads = row_threads(vocab, element_bytes);
  const int cap = device.max_threads > 0 ? device.max_threads : two_read_threads(element_bytes);
  return threads < cap ? threads : cap;
}

// The small-block kernel over every row where its layout fits the row and the device runs at least one such cluster
// at a time (cudaOccupancyMaxActiveClusters: a cluster of 16 needs its blocks' shared memory free on one GPC);
// false (any error left pending for the caller to clear) where it did not launch.
template <typename T, typename In>
bool launch_small_blocks(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight, In* grad, T* logps,
                         T* entropy, const RowResidency& device, cudaStream_t stream) {
  const SmallBlockLayout layout = small_block_layout<T, In>(a.logits.vocab, device);
  if (layout.cluster_blocks == 0) return false;
  const int64_t max_rows = int64_t(0x7fffffff) / layout.cluster_blocks;    // grid.x < 2^31; grid-stride beyond
  int64_t clusters = a.logits.rows < max_rows ? a.logits.rows : max_rows;  // one per row
  const unsigned grid = unsigned(clusters * layout.cluster_blocks);
  constexpr size_t kDefaultShared = 48 * 1024;
  cudaError_t status = cudaSuccess;
  if (layout.shared_bytes + sizeof(SingleReadShared<T>) > kDefaultShared) {
    status = GRPO_ALLOW_DYNAMIC_SHARED(layout.shared_bytes, grpo_loss_from_logits_small_block_kernel<T, In>);
  }
  if (status == cudaSuccess && layout.cluster_blocks > 8) {  // over the portable size
    status = GRPO_ALLOW_NONPORTABLE_CLUSTER(grpo_loss_from_logits_small_block_kernel<T, In>);
  }
  int active = 0;
  if (status == cudaSuccess) {
    status = GRPO_MAX_ACTIVE_CLUSTERS(&active, grid, layout.threads, layout.cluster_blocks, layout.shared_bytes, stream,
                                      grpo_loss_from_logits_small_block_kernel<T, In>);
  }
  if (status != cudaSuccess || active < 1) return false;
  // Persistent: no more clusters than run at once, each walking rows (the kernel's grid-stride loop), so that no
  // cluster waits to be placed on a GPC after the first wave.
  if (device.persistent_clusters && active < clusters) clusters = active;
  status = GRPO_LAUNCH_CLUSTER(unsigned(clusters * layout.cluster_blocks), layout.threads, layout.cluster_blocks,
                               layout.shared_bytes, stream, grpo_loss_from_logits_small_block_kernel<T, In>)(
      a, f, row_weight, grad, logps, entropy, layout.slice);
  return status == cudaSuccess;
}

// The pass over every row: the single-read (small-block) kernel where device.max_cluster_blocks > 0, a row fits 16
// blocks and the device runs such a cluster, else (or if the device refuses that launch) the two-read kernel.
template <typename T, typename In>
void launch_grpo_loss_from_logits(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight, In* grad,
                                  T* logps, T* entropy, const RowResidency& device, cudaStream_t stream) {
  if (a.logits.rows == 0) return;
  if (device.max_cluster_blocks > 0) {
    if (launch_small_blocks<T, In>(a, f, row_weight, grad, logps, entropy, device, stream)) return;
    (void)cudaGetLastError();  // too long a row, or refused: clear any error and take the two-read pass
  }
  const int64_t max_rows = int64_t(1) << 27;  // grid-stride beyond that: any number of rows
  const int64_t rows = a.logits.rows < max_rows ? a.logits.rows : max_rows;
  GRPO_LAUNCH(unsigned(rows), pass_threads(a.logits.vocab, sizeof(In), device), 0, stream,
              grpo_loss_from_logits_kernel<T, In>)(a, f, row_weight, grad, logps, entropy);
}

template <typename T, typename Out>
void launch_scale_rows(const LogitsRows& rows, const T* factor, cudaStream_t stream) {
  if (rows.rows == 0) return;
  const int64_t max_rows = int64_t(1) << 27;
  GRPO_LAUNCH(unsigned(rows.rows < max_rows ? rows.rows : max_rows), row_threads(rows.vocab, sizeof(Out)), 0, stream,
              scale_rows_kernel<T, Out>)(rows, factor);
}

}  // namespace grpo_ext
