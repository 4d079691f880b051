// CUDA kernel of group_advantages, on raw pointers and a stream (no torch types).
//
// group_advantages is one launch of one block: a warp per group (its combined rewards and statistics), a block-wide
// reduction for the batch statistics when they are needed ("batch" scale, GDPO), then a warp per group again for
// the advantages. No host sync; the combined rewards live in the output buffer between the phases. With group_ids,
// a phase 0 first lists each group's rows in a workspace (a counting sort: integer atomics place the rows, then
// each group's rows are put in increasing order, so that every sum runs in the same order on every run).
#pragma once

#include <cuda_runtime.h>

#include "../advantages_math.h"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// NaN-aware mean and std over a group's members [base, base + n) of column `col`, a warp cooperating.
template <typename T, typename Load>
__device__ __forceinline__ void warp_nan_moments(Load load, int64_t n, int64_t ddof, T* mean, T* std_out, T* count) {
  const int lane = threadIdx.x & 31;
  T sum = T(0), cnt = T(0);
  for (int64_t i = lane; i < n; i += 32) {
    const T r = load(i);
    if (is_scored(r)) {
      sum += r;
      cnt += T(1);
    }
  }
  sum = warp_sum(sum);
  cnt = warp_sum(cnt);
  const T mu = safe_mean(sum, cnt);
  T sq = T(0);
  for (int64_t i = lane; i < n; i += 32) {
    const T r = load(i);
    if (is_scored(r)) sq += (r - mu) * (r - mu);
  }
  sq = warp_sum(sq);
  *mean = mu;
  *std_out = std_from_sum_sq(sq, cnt, ddof);
  *count = cnt;
}

// The rows of the groups: contiguous runs of group_size rows, or the lists phase 0 builds from group_ids.
struct GroupRows {
  int64_t group_size = 1;        // contiguous groups
  const int* offsets = nullptr;  // [num_groups + 1]: group g is members[offsets[g] .. offsets[g + 1])
  const int* members = nullptr;  // [B]
  __device__ __forceinline__ int64_t begin(int64_t g) const { return offsets ? offsets[g] : g * group_size; }
  __device__ __forceinline__ int64_t count(int64_t g) const {
    return offsets ? offsets[g + 1] - offsets[g] : group_size;
  }
  __device__ __forceinline__ int64_t row(int64_t position) const { return members ? members[position] : position; }
};

// Phase 0 with group_ids: offsets (exclusive prefix sums of the group sizes) and members (each group's rows in
// increasing order) in the workspace: offsets [num_groups + 1], cursor [num_groups], placed [B], members [B] ints.
__device__ __forceinline__ void list_group_rows(const int64_t* __restrict__ group_ids, int64_t id_stride, int64_t batch,
                                                int64_t num_groups, int* __restrict__ workspace, int* scan) {
  int* offsets = workspace;
  int* cursor = offsets + num_groups + 1;
  int* placed = cursor + num_groups;
  int* members = placed + batch;
  for (int64_t g = threadIdx.x; g <= num_groups; g += blockDim.x) offsets[g] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
    const int64_t id = group_ids[i * id_stride];
    CUDA_KERNEL_ASSERT(id >= 0 && id < num_groups);
    if (id >= 0 && id < num_groups) atomicAdd(&offsets[id + 1], 1);
  }
  __syncthreads();
  // Inclusive scan of offsets[1..num_groups]: each thread scans a contiguous chunk, the chunk totals are scanned.
  const int64_t chunk = (num_groups + blockDim.x - 1) / blockDim.x;
  const int64_t first = 1 + threadIdx.x * chunk, last = first + chunk < num_groups + 1 ? first + chunk : num_groups + 1;
  int total = 0;
  for (int64_t g = first; g < last; ++g) total = offsets[g] += total;
  scan[threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const int own = scan[t];
      scan[t] = running;
      running += own;
    }
  }
  __syncthreads();
  for (int64_t g = first; g < last; ++g) offsets[g] += scan[threadIdx.x];
  __syncthreads();
  for (int64_t g = threadIdx.x; g < num_groups; g += blockDim.x) cursor[g] = offsets[g];
  __syncthreads();
  for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
    const int64_t id = group_ids[i * id_stride];
    if (id >= 0 && id < num_groups) placed[atomicAdd(&cursor[id], 1)] = static_cast<int>(i);
  }
  __syncthreads();
  // The atomics placed a group's rows in any order: each row's rank among them fixes the order.
  for (int64_t position = threadIdx.x; position < batch; position += blockDim.x) {
    const int row = placed[position];
    const int64_t id = group_ids[row * id_stride];
    int rank = 0;
    for (int q = offsets[id]; q < offsets[id + 1]; ++q) rank += placed[q] < row ? 1 : 0;
    members[offsets[id] + rank] = row;
  }
  __syncthreads();
}

// Launched with up to 1024 threads (one warp per group); without the bound the float64 instantiation uses 72
// registers per thread and cannot launch 1024 threads (sm_90: at most 896).
template <typename T>
__global__ void __launch_bounds__(1024)
    group_advantages_kernel(AdvantageParams p, StridedMatrix rewards, StridedMatrix weights, int64_t batch,
                            const int64_t* __restrict__ group_ids, int64_t id_stride, int64_t num_groups,
                            int* __restrict__ workspace, T* __restrict__ adv, T* __restrict__ group_mean,
                            T* __restrict__ group_std, bool* __restrict__ zero_std) {
  __shared__ T scratch[2 * 32];
  __shared__ int scan[1024];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const bool gdpo = p.aggregation == Aggregation::kNormalizeThenSum;
  GroupRows groups;
  groups.group_size = p.group_size;
  if (group_ids) {
    list_group_rows(group_ids, id_stride, batch, num_groups, workspace, scan);
    groups.offsets = workspace;
    groups.members = workspace + 2 * num_groups + 1 + batch;
  }

  // Phase 1: R into adv, and each group's own statistics of R.
  for (int64_t g = warp; g < num_groups; g += num_warps) {
    const int64_t base = groups.begin(g), g_size = groups.count(g);
    if (gdpo) {
      // R starts NaN and turns 0 + ... at its first scored reward: an unscorable row stays NaN (docs/math.md 1).
      for (int64_t i = lane; i < g_size; i += 32) adv[groups.row(base + i)] = T(NAN);
      for (int64_t j = 0; j < p.num_rewards; ++j) {
        T mu, sigma, cnt;
        warp_nan_moments<T>([&](int64_t i) { return rewards.load<T>(groups.row(base + i), j); }, g_size, p.std_ddof,
                            &mu, &sigma, &cnt);
        const T w = weights.present() ? weights.load<T>(0, j) : T(1);
        for (int64_t i = lane; i < g_size; i += 32) {
          const int64_t row = groups.row(base + i);
          const T r = rewards.load<T>(row, j);
          if (is_scored(r)) {
            const T sum = adv[row];
            adv[row] = (sum == sum ? sum : T(0)) + w * (r - mu) / (sigma + T(p.eps));
          }
        }
      }
    } else {
      for (int64_t i = lane; i < g_size; i += 32) {
        const int64_t row = groups.row(base + i);
        adv[row] = combine_rewards<T>(rewards, weights, row, p.num_rewards);
      }
    }
    T mu, sigma, cnt;  // each lane reads back only the entries it wrote
    warp_nan_moments<T>([&](int64_t i) { return adv[groups.row(base + i)]; }, g_size, p.std_ddof, &mu, &sigma, &cnt);
    if (lane == 0) {
      group_mean[g] = mu;
      group_std[g] = sigma;
      zero_std[g] = cnt >= T(2) && sigma <= T(kZeroStdTolerance);
    }
    __syncwarp();  // lane 0's group_std is read by the whole warp in phase 3
  }

  // Phase 2: batch statistics of R.
  T batch_mean = T(0), batch_std = T(0);
  if (gdpo || p.scale == ScaleRewards::kBatch) {
    __syncthreads();
    T s[2] = {T(0), T(0)};
    for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
      const T r = adv[i];
      if (is_scored(r)) {
        s[0] += r;
        s[1] += T(1);
      }
    }
    block_sum<T, 2>(s, scratch);
    batch_mean = safe_mean(s[0], s[1]);
    T sq[1] = {T(0)};
    for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
      const T r = adv[i];
      if (is_scored(r)) sq[0] += (r - batch_mean) * (r - batch_mean);
    }
    block_sum<T, 1>(sq, scratch);
    batch_std = std_from_sum_sq(sq[0], s[1], p.std_ddof);
    __syncthreads();
  }

  // Phase 3: advantages, a warp per group (the same groups as phase 1).
  for (int64_t g = warp; g < num_groups; g += num_warps) {
    const int64_t base = groups.begin(g), g_size = groups.count(g);
    if (gdpo) {
      for (int64_t i = lane; i < g_size; i += 32) {
        const int64_t row = groups.row(base + i);
        const T r = adv[row];
        adv[row] = is_scored(r) ? (r - batch_mean) / (batch_std + T(p.eps)) : T(0);
      }
      continue;
    }
    T sum = T(0), cnt = T(0);
    for (int64_t i = lane; i < g_size; i += 32) {
      const T r = adv[groups.row(base + i)];
      if (is_scored(r)) {
        sum += r;
        cnt += T(1);
      }
    }
    sum = warp_sum(sum);
    cnt = warp_sum(cnt);
    const T sigma = p.scale == ScaleRewards::kBatch ? batch_std : group_std[g];
    // Not unrolled: a group of up to 32 rows is one iteration, and the unrolled copies (a division call each) kept
    // a pointer live across the calls that spilled in float64 (4 B).
#pragma unroll 1
    for (int64_t i = lane; i < g_size; i += 32) {
      const int64_t row = groups.row(base + i);
      const T r = adv[row];
      bool valid;
      const T b = baseline_for(r, sum, cnt, p, &valid);
      adv[row] = advantage_from(r, b, valid, sigma, g_size == 1, p);
    }
  }
}

// Ints of workspace group_advantages needs with group_ids (none without).
inline int64_t group_rows_workspace_size(int64_t batch, int64_t num_groups) {
  return 2 * num_groups + 1 + 2 * batch;
}

// Contiguous groups: group_ids null, num_groups = batch / group_size. With group_ids ([B] int64, stride id_stride,
// values in [0, num_groups)): workspace holds group_rows_workspace_size ints.
template <typename T>
void launch_group_advantages(const AdvantageParams& p, const StridedMatrix& rewards, const StridedMatrix& weights,
                             int64_t batch, const int64_t* group_ids, int64_t id_stride, int64_t num_groups,
                             int* workspace, T* adv, T* group_mean, T* group_std, bool* zero_std, cudaStream_t stream) {
  const int64_t want = num_groups * 32;
  const int threads = want >= 1024 ? 1024 : round_up_to_warp(want < 32 ? 32 : want);
  GRPO_LAUNCH(1, threads, 0, stream, group_advantages_kernel<T>)(
      p, rewards, weights, batch, group_ids, id_stride, num_groups, workspace, adv, group_mean, group_std, zero_std);
}

}  // namespace grpo_ext
