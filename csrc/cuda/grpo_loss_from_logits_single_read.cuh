// The single-read pass of the fused GRPO loss from logits (GRPO_EXT_LOGITS_SINGLE_READ=1; grpo_loss_from_logits.cuh
// has the op's overview and the two-read kernel): each row staged in shared memory, split over a thread-block cluster
// of up to 16 small blocks whose row statistics are exchanged by mbarrier pushes (cluster.cuh), so that HBM sees each
// row once; the layout table (small_block_layout) and its launcher (launch_small_blocks).
#pragma once

#include <cuda_runtime.h>

#include "cluster.cuh"
#include "grpo_loss_from_logits_row.cuh"
#include "launch.cuh"

namespace grpo_ext {

// row_state (selective_log_softmax.cuh) while staging the part x[0, n) in shared memory (single-read pass).
template <SoftCap kCap, typename T, typename In>
__device__ __forceinline__ SoftmaxState<T> staged_row_state(const LogitTransform<T>& f, const In* x, In* staged,
                                                            int64_t n) {
  SoftmaxState<T> s{T(0), T(0), T(0)};
  stage_row<T>(
      x, staged, n, [&](T logit) { s = add_logit<kCap>(s, f, logit); },
      [&](const auto& chunk) { s = add_logits<kCap>(s, chunk, f); });
  return s;
}

// What each block of a row's cluster pushes to every block of it (the single-read pass): its part's softmax state,
// and from the block whose part holds the row's chosen token, that token's raw logit (0 from the others).
template <typename T>
struct alignas(16) PartState {
  SoftmaxState<T> state;
  T chosen_logit;
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
// (kExchange: cluster_num_blocks() blocks, 2 to 16, one cluster per row), or a lone block holding the whole row where
// it fits one block's shared memory (!kExchange: launched without a cluster, exchanging nothing, since PTX leaves
// st.async into a one-block cluster's own shared memory undefined; a compile-time choice, so that the clusters'
// kernel carries none of the lone block's code: benchmarks/NOTES.md, "The lone block as its own kernel").
// Each block copies its part into dynamic shared memory (cp.async: the whole part in flight at once) and accumulates
// the part's softmax state from there; warp 0 of each block pushes that state into every block's inbox
// (cluster_push: st.async into distributed shared memory, counted on the receiver's mbarrier), waits for the
// cluster's states to land in its own inbox, and merges them in the same fixed order in every block (the same bits
// everywhere); each block then writes its part's gradient from shared memory. HBM sees each row once, and the
// chosen token's logit comes from the staged part that holds it. No cluster barrier per row and none at exit: a
// block receives pushes only for rows it waits on, so nothing lands after it exits, and no block reads a peer's
// shared memory. The small-block kernel runs it (256 threads, clusters of up to 16, several blocks per SM:
// small_block_layout).
template <bool kExchange, typename T, typename In>
__device__ __forceinline__ void single_read_pass(const LogitsPassArgs& a, const LogitTransform<T>& f,
                                                 const T* __restrict__ row_weight, In* grad, T* __restrict__ logps,
                                                 T* __restrict__ entropy, int64_t slice, SingleReadShared<T>& sh) {
  In* const staged_base = dynamic_shared<In>();  // slice + one vector of elements
  const unsigned rank = kExchange ? cluster_block_rank() : 0u, blocks = kExchange ? cluster_num_blocks() : 1u;
  // the inbox's slots; and no st.async to itself: a cluster kernel always runs in a cluster of at least 2
  CUDA_KERNEL_ASSERT(kExchange ? blocks > 1 && blocks <= kMaxClusterBlocks : cluster_num_blocks() == 1);
  const int64_t vocab = a.logits.vocab, lo = rank * slice;
  const int64_t n = lo < vocab ? (vocab - lo < slice ? vocab - lo : slice) : 0;
  if constexpr (kExchange) {
    if (threadIdx.x == 0) {
      mbarrier_init(&sh.inbox_full[0], 1);  // one arrival a phase: this block's thread 0 announcing the bytes
      mbarrier_init(&sh.inbox_full[1], 1);
    }
    cluster_sync_mbarrier_init();  // no peer pushes before this block's mbarriers exist
  }
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
      if (id >= lo && id < lo + n) mine.chosen_logit = load_as<T>(staged + (id - lo));
      SoftmaxState<T> part{T(0), T(0), T(0)};
      T chosen_logit = mine.chosen_logit;  // a lone block's part is the whole row, chosen token included
      if constexpr (kExchange) {
        Mbarrier* const full = &sh.inbox_full[parity];
        if (lane == 0) mbarrier_arrive_expect_tx(full, blocks * unsigned(sizeof(PartState<T>)));
        if (lane < blocks) cluster_push(&sh.inbox[parity][rank], lane, mine, full);
        mbarrier_wait(full, (phases >> parity) & 1u);
        part = lane < blocks ? sh.inbox[parity][lane].state : SoftmaxState<T>{T(0), T(0), T(0)};
        chosen_logit = sh.inbox[parity][id / slice].chosen_logit;
      } else {
        if (lane == 0) part = mine.state;
      }
      // Lane k merges rank k's state by warp_merge's fixed shuffle tree, the same in every block: the same bits
      // everywhere.
      const SoftmaxState<T> total = warp_merge(part);
      if (lane == 0) {
        const ChosenToken<T> chosen{id, chosen_logit};
        finish_row(a, f, row_weight, chosen, total, row, grad_row != nullptr, rank == 0, logps, entropy, sh.pass);
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
  single_read_pass<true>(a, f, row_weight, grad, logps, entropy, slice, sh);
}

// The same pass for a row that fits one block (cluster_blocks == 1 in small_block_layout): no cluster, no exchange.
template <typename T, typename In>
__global__ void __launch_bounds__(256, 4)  // kSmallBlockThreads, kSmallBlocksPerSm (tests/cuda_emu reads numbers)
    grpo_loss_from_logits_lone_block_kernel(LogitsPassArgs a, LogitTransform<T> f, const T* __restrict__ row_weight,
                                            In* grad, T* __restrict__ logps, T* __restrict__ entropy, int64_t slice) {
  __shared__ SingleReadShared<T> sh;
  single_read_pass<false>(a, f, row_weight, grad, logps, entropy, slice, sh);
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

// The single-read launch's steps for one kernel, written by the caller as `allow_shared()`, `max_active(&active,
// grid)` and `start(grid)` around the launch macros (each macro names its kernel, as the emulated device's launch
// record asks): the dynamic shared memory allowed where the block's static and dynamic bytes pass the 48 KiB
// default, the occupancy API's clusters at once (none: false), then one cluster a row, or with persistent clusters
// no more than run at once, each walking rows (the kernel's grid-stride loop).
template <typename T, typename AllowShared, typename MaxActive, typename Start>
bool launch_single_read(const SmallBlockLayout& layout, int64_t rows, bool persistent, AllowShared&& allow_shared,
                        MaxActive&& max_active, Start&& start) {
  const int64_t max_rows = int64_t(0x7fffffff) / layout.cluster_blocks;  // grid.x < 2^31; grid-stride beyond
  int64_t clusters = rows < max_rows ? rows : max_rows;                  // one per row
  constexpr size_t kDefaultShared = 48 * 1024;
  cudaError_t status = cudaSuccess;
  if (layout.shared_bytes + sizeof(SingleReadShared<T>) > kDefaultShared) status = allow_shared();
  int active = 0;
  if (status == cudaSuccess) status = max_active(&active, unsigned(clusters * layout.cluster_blocks));
  if (status != cudaSuccess || active < 1) return false;
  if (persistent && active < clusters) clusters = active;
  return start(unsigned(clusters * layout.cluster_blocks)) == cudaSuccess;
}

// The small-block kernel (clusters of 2 to 16) or the lone-block kernel (a row in one block) over every row where
// its layout fits the row and the device runs at least one such cluster at a time (cudaOccupancyMaxActiveClusters:
// a cluster of 16 needs its blocks' shared memory free on one GPC); false (any error left pending for the caller to
// clear) where it did not launch.
template <typename T, typename In>
bool launch_small_blocks(const LogitsPassArgs& a, const LogitTransform<T>& f, const T* row_weight, In* grad, T* logps,
                         T* entropy, const RowResidency& device, cudaStream_t stream) {
  const SmallBlockLayout layout = small_block_layout<T, In>(a.logits.vocab, device);
  if (layout.cluster_blocks == 0) return false;
  const size_t bytes = layout.shared_bytes;
  const int threads = layout.threads;
  const unsigned blocks = layout.cluster_blocks;
  if (blocks == 1) {
    return launch_single_read<T>(
        layout, a.logits.rows, device.persistent_clusters,
        [&] { return GRPO_ALLOW_DYNAMIC_SHARED(bytes, grpo_loss_from_logits_lone_block_kernel<T, In>); },
        [&](int* active, unsigned grid) {
          return GRPO_MAX_ACTIVE_CLUSTERS(active, grid, threads, 1, bytes, stream,
                                          grpo_loss_from_logits_lone_block_kernel<T, In>);
        },
        [&](unsigned grid) {
          return GRPO_LAUNCH_CLUSTER(grid, threads, 1, bytes, stream, grpo_loss_from_logits_lone_block_kernel<T, In>)(
              a, f, row_weight, grad, logps, entropy, layout.slice);
        });
  }
  return launch_single_read<T>(
      layout, a.logits.rows, device.persistent_clusters,
      [&] { return GRPO_ALLOW_DYNAMIC_SHARED(bytes, grpo_loss_from_logits_small_block_kernel<T, In>); },
      [&](int* active, unsigned grid) {
        if (blocks > 8) {  // over the portable size
          const cudaError_t status = GRPO_ALLOW_NONPORTABLE_CLUSTER(grpo_loss_from_logits_small_block_kernel<T, In>);
          if (status != cudaSuccess) return status;
        }
        return GRPO_MAX_ACTIVE_CLUSTERS(active, grid, threads, blocks, bytes, stream,
                                        grpo_loss_from_logits_small_block_kernel<T, In>);
      },
      [&](unsigned grid) {
        return GRPO_LAUNCH_CLUSTER(grid, threads, blocks, bytes, stream,
                                   grpo_loss_from_logits_small_block_kernel<T, In>)(a, f, row_weight, grad, logps,
                                                                                    entropy, layout.slice);
      });
}

}  // namespace grpo_ext
