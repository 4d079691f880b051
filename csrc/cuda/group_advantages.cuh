// CUDA kernel of group_advantages, on raw pointers and a stream (no torch types).
//
// group_advantages is one launch of one block: a warp per group (its combined rewards and statistics), a block-wide
// reduction for the batch statistics when they are needed ("batch" scale, GDPO), then a warp per group again for
// the advantages. No host sync, no atomics; the combined rewards live in the output buffer between the phases.
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

// Launched with up to 1024 threads (one warp per group); without the bound the float64 instantiation uses 72
// registers per thread and cannot launch 1024 threads (sm_90: at most 896).
template <typename T>
__global__ void __launch_bounds__(1024)
    group_advantages_kernel(AdvantageParams p, StridedMatrix rewards, StridedMatrix weights, int64_t batch,
                            T* __restrict__ adv, T* __restrict__ group_mean, T* __restrict__ group_std,
                            bool* __restrict__ zero_std) {
  __shared__ T scratch[2 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t g_size = p.group_size, num_groups = batch / g_size;
  const bool gdpo = p.aggregation == Aggregation::kNormalizeThenSum;

  // Phase 1: R into adv, and each group's own statistics of R.
  for (int64_t g = warp; g < num_groups; g += num_warps) {
    const int64_t base = g * g_size;
    if (gdpo) {
      // R starts NaN and turns 0 + ... at its first scored reward: an unscorable row stays NaN (docs/math.md 1).
      for (int64_t i = lane; i < g_size; i += 32) adv[base + i] = T(NAN);
      for (int64_t j = 0; j < p.num_rewards; ++j) {
        T mu, sigma, cnt;
        warp_nan_moments<T>([&](int64_t i) { return rewards.load<T>(base + i, j); }, g_size, p.std_ddof, &mu, &sigma,
                            &cnt);
        const T w = weights.present() ? weights.load<T>(0, j) : T(1);
        for (int64_t i = lane; i < g_size; i += 32) {
          const T r = rewards.load<T>(base + i, j);
          if (is_scored(r)) {
            const T sum = adv[base + i];
            adv[base + i] = (sum == sum ? sum : T(0)) + w * (r - mu) / (sigma + T(p.eps));
          }
        }
      }
    } else {
      for (int64_t i = lane; i < g_size; i += 32)
        adv[base + i] = combine_rewards<T>(rewards, weights, base + i, p.num_rewards);
    }
    T mu, sigma, cnt;  // each lane reads back only the entries it wrote
    warp_nan_moments<T>([&](int64_t i) { return adv[base + i]; }, g_size, p.std_ddof, &mu, &sigma, &cnt);
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
    const int64_t base = g * g_size;
    if (gdpo) {
      for (int64_t i = lane; i < g_size; i += 32) {
        const T r = adv[base + i];
        adv[base + i] = is_scored(r) ? (r - batch_mean) / (batch_std + T(p.eps)) : T(0);
      }
      continue;
    }
    T sum = T(0), cnt = T(0);
    for (int64_t i = lane; i < g_size; i += 32) {
      const T r = adv[base + i];
      if (is_scored(r)) {
        sum += r;
        cnt += T(1);
      }
    }
    sum = warp_sum(sum);
    cnt = warp_sum(cnt);
    const T sigma = p.scale == ScaleRewards::kBatch ? batch_std : group_std[g];
    for (int64_t i = lane; i < g_size; i += 32) {
      const T r = adv[base + i];
      bool valid;
      const T b = baseline_for(r, sum, cnt, p, &valid);
      adv[base + i] = advantage_from(r, b, valid, sigma, p);
    }
  }
}

template <typename T>
void launch_group_advantages(const AdvantageParams& p, const StridedMatrix& rewards, const StridedMatrix& weights,
                             int64_t batch, T* adv, T* group_mean, T* group_std, bool* zero_std, cudaStream_t stream) {
  const int64_t num_groups = batch / p.group_size;
  const int64_t want = num_groups * 32;
  const int threads = want >= 1024 ? 1024 : round_up_to_warp(want < 32 ? 32 : want);
  GRPO_LAUNCH(1, threads, 0, stream, group_advantages_kernel<T>)(p, rewards, weights, batch, adv, group_mean, group_std,
                                                                 zero_std);
}

}  // namespace grpo_ext
