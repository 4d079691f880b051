// CUDA kernels of group_advantages, on raw pointers and a stream (no torch types).
//
// A grid that grows with the groups. A group is handled by a team of `team_width` lanes of one warp (a power of two
// up to 32, chosen from the group size, so that groups of 8 put four groups in a warp); a block's teams take one
// tile of consecutive groups at a time. The tiles, not the blocks, fix every reduction tree, so the bits do not
// depend on how many blocks the launcher (or the emulator's grid cap) gives.
//
// Launches on the stream, in order (no host sync, deterministic):
//   group_size, scale "group" or "none":  group_advantages_kernel (1 launch)
//   + scale "batch" or GDPO:              a memset of 4 bytes, then group_advantages_kernel, whose last block merges
//                                         the tiles' moments (float64, each in units of a power of two) into the
//                                         batch mean and std, then
//                                         group_advantages_scale_kernel (3 launches)
//   + group_ids:                          a memset of the group counts, group_rows_count_kernel (counts, and its
//                                         last block's prefix sum), group_rows_place_kernel (each row in its
//                                         group's list, in any order); group_advantages_kernel's teams then sort
//                                         their group's rows into increasing order, so that every sum runs in the
//                                         same order on every run (3 more launches)
// The combined rewards R live in registers (a lane's first member) and in the advantages buffer (the others, and
// all of them between the kernels).
#pragma once

#include <cuda_runtime.h>

#include "../advantages_math.h"
#include "group_rows.cuh"
#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// Sum over a team of `width` lanes (a power of two <= 32; the warp's teams at once); every lane gets its team's sum.
template <typename T>
__device__ __forceinline__ T team_sum(T v, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullWarp, v, offset, width);
  return __shfl_sync(kFullWarp, v, 0, width);
}

// Max over a team, as team_sum (no NaN).
template <typename T>
__device__ __forceinline__ T team_max(T v, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) {
    const T other = __shfl_down_sync(kFullWarp, v, offset, width);
    v = other > v ? other : v;
  }
  return __shfl_sync(kFullWarp, v, 0, width);
}

// NaN-aware moments of a group's members (index 0 .. n), a team cooperating: lane `lane` of `width` takes members
// lane, lane + width, ...; n may differ between the teams of a warp (0 for a team without a group).
// The moments are of the values as loaded (combine_group: R in units of 2^exponent, advantages_math.h).
template <typename T>
struct TeamMoments {
  T sum, count, mean, sum_sq_dev, std;
  T own;         // combine_group: R of the lane's first member (index lane), kept in a register
  int exponent;  // combine_group: R is stored as R * 2^-exponent
};

// scale_exponent (advantages_math.h) of the largest scored magnitude among a group's values, a team cooperating.
template <typename T, typename Load>
__device__ __forceinline__ int team_scale_exponent(Load load, int64_t n, int width, int lane) {
  T max_abs = T(0);
  for (int64_t i = lane; i < n; i += width) max_abs = max_scored_abs(max_abs, load(i));
  return scale_exponent(team_max(max_abs, width));
}

template <typename T, typename Load>
__device__ __forceinline__ TeamMoments<T> team_nan_moments(Load load, int64_t n, int64_t ddof, int width, int lane) {
  TeamMoments<T> m;
  T sum = T(0), cnt = T(0);
  for (int64_t i = lane; i < n; i += width) {
    const T r = load(i);
    if (is_scored(r)) {
      sum += r;
      cnt += T(1);
    }
  }
  m.sum = team_sum(sum, width);
  m.count = team_sum(cnt, width);
  m.mean = safe_mean(m.sum, m.count);
  T sq = T(0);
  for (int64_t i = lane; i < n; i += width) {
    const T r = load(i);
    if (is_scored(r)) sq += (r - m.mean) * (r - m.mean);
  }
  m.sum_sq_dev = team_sum(sq, width);
  m.std = std_from_sum_sq(m.sum_sq_dev, m.count, ddof);
  return m;
}

// Everything the kernels of one call share (passed by value).
template <typename T>
struct GroupAdvantagesArgs {
  AdvantageParams p;
  StridedMatrix rewards, weights;
  int64_t batch = 0, num_groups = 0;
  GroupRows groups;
  int team_width = 32;       // lanes per group
  int team_shift = 5;        // log2(team_width)
  int64_t tiles = 0;         // tiles of blockDim.x / team_width groups (the kernels' grid-stride range)
  T* adv = nullptr;          // [B]: R after the main kernel, the advantages after the last
  T* group_mean = nullptr;   // [num_groups]
  T* group_std = nullptr;    // [num_groups]
  bool* zero_std = nullptr;  // [num_groups]
  // Batch statistics, each in units of a power of two (advantages_math.h): the tile's or the batch's exponent.
  double* tile_moments = nullptr;   // [4 * tiles]: count, mean, sum of squared deviations, exponent; null: none
  double* batch_moments = nullptr;  // [3]: the batch mean and std of R, and their exponent
  int* exponents = nullptr;         // [num_groups]: each group's R is stored as R * 2^-exponent (batch statistics)
  int* blocks_done = nullptr;       // the main kernel's finished blocks (zeroed before it)

  __device__ __forceinline__ bool batch_statistics() const { return tile_moments != nullptr; }
};

// R of a group's members (GDPO: the sum of each reward's z-score inside the group), and the moments of R, all in
// units of 2^exponent (advantages_math.h: 0 unless R or a reward exceeds 2^40). Each lane keeps R of its first
// member (index lane) in a register (`own` of the result); the others go to adv (every member's when `store_all`: a
// later kernel reads them), and each lane reads back only the entries it wrote.
template <typename T>
__device__ __forceinline__ TeamMoments<T> combine_group(const GroupAdvantagesArgs<T>& a, int64_t base, int64_t n,
                                                        bool store_all, const TeamLayout& t) {
  const AdvantageParams& p = a.p;
  T own = T(NAN), max_abs = T(0);  // max_abs: the largest magnitude of a scored R
  int exponent = 0;
  if (p.aggregation == Aggregation::kNormalizeThenSum) {
    // R starts NaN and turns 0 + ... at its first scored reward: an unscorable row stays NaN (docs/math.md 1).
    for (int64_t i = t.lane; i < n; i += t.width) a.adv[a.groups.row(base + i)] = T(NAN);
    for (int64_t j = 0; j < p.num_rewards; ++j) {
      const auto column = [&](int64_t i) { return a.rewards.template load<T>(a.groups.row(base + i), j); };
      const GroupScale<T> s = group_scale<T>(team_scale_exponent<T>(column, n, t.width, t.lane), p.eps);
      const T unit = times_pow2(T(1), -s.exponent);
      const TeamMoments<T> m =
          team_nan_moments<T>([&](int64_t i) { return column(i) * unit; }, n, p.std_ddof, t.width, t.lane);
      const T w = a.weights.present() ? a.weights.template load<T>(0, j) : T(1);
      for (int64_t i = t.lane; i < n; i += t.width) {
        const int64_t row = a.groups.row(base + i);
        const T r = a.rewards.template load<T>(row, j);
        if (is_scored(r)) {
          const T sum = a.adv[row];
          a.adv[row] = (sum == sum ? sum : T(0)) + scaled_ratio(w * (r * unit - m.mean), m.std + s.eps);
        }
      }
    }
    if (t.lane < n) own = a.adv[a.groups.row(base + t.lane)];
    for (int64_t i = t.lane; i < n; i += t.width) {
      max_abs = max_scored_abs(max_abs, i == t.lane ? own : a.adv[a.groups.row(base + i)]);
    }
  } else {
    bool overflow = false;  // a weighted sum of rewards beyond the dtype's range (+-inf)
    for (int64_t i = t.lane; i < n; i += t.width) {
      const int64_t row = a.groups.row(base + i);
      const T r = combine_rewards<T>(a.rewards, a.weights, row, p.num_rewards);
      if (i == t.lane) own = r;
      if (store_all || i != t.lane) a.adv[row] = r;
      max_abs = max_scored_abs(max_abs, r);
      overflow |= combined_overflow(r);
    }
    // Then sum the rewards in units of their largest magnitude, as the CPU kernel. The test is warp-wide: the team
    // reductions need every lane of the warp.
    if (__any_sync(kFullWarp, overflow)) {
      T reward_max = T(0);
      for (int64_t i = t.lane; i < n; i += t.width) {
        reward_max =
            max_scored_abs(reward_max, row_max_scored_abs<T>(a.rewards, a.groups.row(base + i), p.num_rewards));
      }
      reward_max = team_max(reward_max, t.width);
      if (team_max(overflow ? T(1) : T(0), t.width) > T(0)) {
        exponent = magnitude_exponent(reward_max);
        const T unit = times_pow2(T(1), -exponent);
        max_abs = T(0);
        for (int64_t i = t.lane; i < n; i += t.width) {
          const int64_t row = a.groups.row(base + i);
          const T r = combine_rewards<T>(a.rewards, a.weights, row, p.num_rewards, unit);
          if (i == t.lane) own = r;
          if (store_all || i != t.lane) a.adv[row] = r;
          max_abs = max_scored_abs(max_abs, r);
        }
      }
    }
  }
  // R beyond 2^40: scaled down before its statistics (a pass only then).
  const int extra = scale_exponent(team_max(max_abs, t.width));
  if (extra != 0) {
    const T unit = times_pow2(T(1), -extra);  // a normal number (extra <= the cap of magnitude_exponent)
    for (int64_t i = t.lane; i < n; i += t.width) {
      if (i == t.lane) own *= unit;
      if (store_all || i != t.lane) a.adv[a.groups.row(base + i)] *= unit;
    }
    exponent += extra;
  }
  TeamMoments<T> m = team_nan_moments<T>([&](int64_t i) { return i == t.lane ? own : a.adv[a.groups.row(base + i)]; },
                                         n, p.std_ddof, t.width, t.lane);
  m.own = own;
  m.exponent = exponent;
  return m;
}

// The advantages of a group from R (`own` for the lane's first member, adv for the others), the group's scored sum
// and count of R, and the scale.
template <typename T>
__device__ __forceinline__ void write_advantages(const GroupAdvantagesArgs<T>& a, int64_t base, int64_t n, T sum,
                                                 T count, T sigma, const TeamLayout& t, T own,
                                                 const GroupScale<T>& scale) {
  // Not unrolled: the unrolled copies (a division call each) kept a pointer live across the calls that spilled in
  // float64.
#pragma unroll 1
  for (int64_t i = t.lane; i < n; i += t.width) {
    const int64_t row = a.groups.row(base + i);
    const T r = i == t.lane ? own : a.adv[row];
    bool valid;
    const T b = baseline_for(r, sum, count, a.p, &valid);
    a.adv[row] = advantage_from(r, b, valid, sigma, n == 1, a.p, scale);
  }
}

// Float64 moments of a set of values: count, mean, sum of squared deviations about the mean.
struct Moments {
  double count, mean, sum_sq_dev;
};

// Block-wide moments from parts given as (count, sum, mean, sum of squared deviations about that mean): Chan's merge
// as two fixed-order block sums, so every thread gets the same bits. Threads without a part pass count 0.
__device__ __forceinline__ Moments block_merge_moments(double count, double sum, double mean, double sum_sq_dev,
                                                       double* scratch) {
  double totals[2] = {count, sum};
  block_sum<double, 2>(totals, scratch);
  const double merged_mean = totals[0] > 0 ? totals[1] / totals[0] : 0.0;
  double spread[1] = {count > 0 ? sum_sq_dev + count * (mean - merged_mean) * (mean - merged_mean) : 0.0};
  block_sum<double, 1>(spread, scratch);
  return {totals[0], merged_mean, spread[0]};
}

// Phase 1 (and, without batch statistics, the advantages): a team per group, a block per tile of groups.
template <typename T>
__global__ void __launch_bounds__(256) group_advantages_kernel(GroupAdvantagesArgs<T> a) {
  __shared__ double scratch[2 * 32];
  __shared__ int exponent_scratch[32];
  __shared__ bool last_block;
  const TeamLayout t(a.team_width, a.team_shift);
  const int64_t num_tiles = a.tiles;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t g = tile * t.teams + t.team;
    const bool real = g < a.num_groups;
    const int64_t base = real ? a.groups.begin(g) : 0, n = real ? a.groups.count(g) : 0;
    if (a.groups.placed) sort_group_rows(a.groups, base, n, t);
    const TeamMoments<T> m = combine_group(a, base, n, a.batch_statistics(), t);
    if (real && t.lane == 0) {
      a.group_mean[g] = times_pow2(m.mean, m.exponent);
      const T sigma = times_pow2(m.std, m.exponent);  // +inf beyond the dtype's range (float32: 3.4e38)
      a.group_std[g] = sigma;
      a.zero_std[g] = m.count >= T(2) && sigma <= T(kZeroStdTolerance);
      if (a.batch_statistics()) a.exponents[g] = m.exponent;
    }
    if (!a.batch_statistics()) {
      write_advantages(a, base, n, m.sum, m.count, m.std, t, m.own, group_scale<T>(m.exponent, a.p.eps));
      continue;
    }
    // This tile's moments of R (each team's lane 0 brings its group's), for the batch statistics, in units of the
    // tile's largest exponent (exponents are >= 0, and 0 for a team without a group).
    const bool part = real && t.lane == 0;
    const int tile_exponent = block_max(m.exponent, exponent_scratch);
    const int shift = m.exponent - tile_exponent;
    const Moments merged =
        block_merge_moments(part ? double(m.count) : 0.0, part ? times_pow2(double(m.sum), shift) : 0.0,
                            times_pow2(double(m.mean), shift), times_pow2(double(m.sum_sq_dev), 2 * shift), scratch);
    if (threadIdx.x == 0) {
      a.tile_moments[4 * tile] = merged.count;
      a.tile_moments[4 * tile + 1] = merged.mean;
      a.tile_moments[4 * tile + 2] = merged.sum_sq_dev;
      a.tile_moments[4 * tile + 3] = double(tile_exponent);
    }
  }
  if (!a.batch_statistics()) return;

  // Phase 2, in the last block to finish: the batch moments of R from the tiles', in tile order.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's tile moments (thread 0 wrote them) before its ticket
    last_block = atomicAdd(a.blocks_done, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  const volatile double* tiles = a.tile_moments;  // written by other blocks: read past the L1
  // In units of the largest tile exponent: each tile's mean and sum of squared deviations brought to them.
  int local_exponent = 0;
  for (int64_t k = threadIdx.x; k < num_tiles; k += blockDim.x) {
    const int e = static_cast<int>(tiles[4 * k + 3]);
    local_exponent = e > local_exponent ? e : local_exponent;
  }
  const int batch_exponent = block_max(local_exponent, exponent_scratch);
  double count = 0, sum = 0;
  for (int64_t k = threadIdx.x; k < num_tiles; k += blockDim.x) {
    count += tiles[4 * k];
    sum += tiles[4 * k] * times_pow2(double(tiles[4 * k + 1]), static_cast<int>(tiles[4 * k + 3]) - batch_exponent);
  }
  double totals[2] = {count, sum};
  block_sum<double, 2>(totals, scratch);
  const double mean = totals[0] > 0 ? totals[1] / totals[0] : 0.0;
  double spread[1] = {0.0};
  for (int64_t k = threadIdx.x; k < num_tiles; k += blockDim.x) {
    const int shift = static_cast<int>(tiles[4 * k + 3]) - batch_exponent;
    const double d = times_pow2(double(tiles[4 * k + 1]), shift) - mean;
    spread[0] += times_pow2(double(tiles[4 * k + 2]), 2 * shift) + tiles[4 * k] * d * d;
  }
  block_sum<double, 1>(spread, scratch);
  if (threadIdx.x == 0) {
    a.batch_moments[0] = mean;
    a.batch_moments[1] = std_from_sum_sq(spread[0], totals[0], a.p.std_ddof);
    a.batch_moments[2] = double(batch_exponent);
  }
}

// Phase 3 with batch statistics: the advantages from R and the batch mean and std (same teams and tiles).
template <typename T>
__global__ void __launch_bounds__(256) group_advantages_scale_kernel(GroupAdvantagesArgs<T> a) {
  const TeamLayout t(a.team_width, a.team_shift);
  // The batch mean and std in units of 2^batch_exponent; each group's R in units of 2^exponents[g].
  const int batch_exponent = static_cast<int>(a.batch_moments[2]);
  const T batch_mean = T(a.batch_moments[0]), batch_std = T(a.batch_moments[1]);
  const int64_t num_tiles = a.tiles;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t g = tile * t.teams + t.team;
    const bool real = g < a.num_groups;
    const int64_t base = real ? a.groups.begin(g) : 0, n = real ? a.groups.count(g) : 0;
    const int exponent = real ? a.exponents[g] : 0;
    if (a.p.aggregation == Aggregation::kNormalizeThenSum) {
      const T sigma_eps = batch_std + group_scale<T>(batch_exponent, a.p.eps).eps;
      const Pow2<T> to_batch(exponent - batch_exponent);
      for (int64_t i = t.lane; i < n; i += t.width) {
        const int64_t row = a.groups.row(base + i);
        const T r = to_batch(a.adv[row]);
        a.adv[row] = is_scored(r) ? scaled_ratio(r - batch_mean, sigma_eps) : T(0);
      }
      continue;
    }
    // R of the lane's first member stays in a register for write_advantages: each R is read once.
    const T own = t.lane < n ? a.adv[a.groups.row(base + t.lane)] : T(0);
    T sum = T(0), cnt = T(0);
    for (int64_t i = t.lane; i < n; i += t.width) {
      const T r = i == t.lane ? own : a.adv[a.groups.row(base + i)];
      if (is_scored(r)) {
        sum += r;
        cnt += T(1);
      }
    }
    // The batch std in the group's units (+inf beyond the dtype's range: then A is 0, its limit).
    const T sigma = times_pow2(batch_std, batch_exponent - exponent);
    write_advantages(a, base, n, team_sum(sum, t.width), team_sum(cnt, t.width), sigma, t, own,
                     group_scale<T>(exponent, a.p.eps));
  }
}

// How a call launches: block size, team width, tiles, and the workspace it needs.
struct GroupAdvantagesLaunch {
  int threads = 32, team_width = 32, team_shift = 5;
  int64_t tiles = 0;
  bool indexed = false, batch_statistics = false;
  // Workspace, in bytes from its start: float64 tile and batch moments first, then ints: the two kernels' finished
  // block counters, then (group_ids) offsets [num_groups + 1], cursor [num_groups], placed [B], members [B], then
  // (batch statistics) the groups' exponents [num_groups].
  int64_t tile_moments_at = 0, batch_moments_at = 0, counters_at = 0, offsets_at = 0, cursor_at = 0, placed_at = 0,
          members_at = 0, exponents_at = 0, bytes = 0;
};

inline GroupAdvantagesLaunch plan_group_advantages_launch(const AdvantageParams& p, int64_t batch, int64_t num_groups,
                                                          bool indexed) {
  GroupAdvantagesLaunch l;
  l.indexed = indexed;
  l.batch_statistics = p.aggregation == Aggregation::kNormalizeThenSum || p.scale == ScaleRewards::kBatch;
  // A team as wide as the (mean) group, up to a warp: groups of 8 put four groups in a warp.
  const int64_t group = indexed ? (num_groups > 0 ? (batch + num_groups - 1) / num_groups : 1) : p.group_size;
  while (l.team_width > 1 && l.team_width / 2 >= group) {
    l.team_width /= 2;
    --l.team_shift;
  }
  const int64_t want = num_groups * l.team_width;
  l.threads = want >= 256 ? 256 : round_up_to_warp(want < 32 ? 32 : want);
  const int64_t teams = l.threads / l.team_width;
  l.tiles = (num_groups + teams - 1) / teams;
  int64_t at = 0;
  l.tile_moments_at = at;
  at += l.batch_statistics ? 4 * l.tiles * int64_t(sizeof(double)) : 0;
  l.batch_moments_at = at;
  at += l.batch_statistics ? 3 * int64_t(sizeof(double)) : 0;
  l.counters_at = at;
  at += 2 * int64_t(sizeof(int));
  l.offsets_at = at;
  if (indexed) {
    at += (num_groups + 1) * int64_t(sizeof(int));
    l.cursor_at = at;
    at += num_groups * int64_t(sizeof(int));
    l.placed_at = at;
    at += batch * int64_t(sizeof(int));
    l.members_at = at;
    at += batch * int64_t(sizeof(int));
  }
  l.exponents_at = at;
  at += l.batch_statistics ? num_groups * int64_t(sizeof(int)) : 0;
  l.bytes = at;
  return l;
}

// Contiguous groups: group_ids null, num_groups = batch / group_size. With group_ids ([B] int64, stride id_stride,
// values in [0, num_groups)). `workspace`: plan.bytes bytes, 8-byte aligned. Returns the first error of the
// workspace's memset (launch errors stay pending for cudaGetLastError).
template <typename T>
cudaError_t launch_group_advantages(const AdvantageParams& p, const StridedMatrix& rewards,
                                    const StridedMatrix& weights, int64_t batch, const int64_t* group_ids,
                                    int64_t id_stride, int64_t num_groups, const GroupAdvantagesLaunch& plan,
                                    void* workspace, T* adv, T* group_mean, T* group_std, bool* zero_std,
                                    cudaStream_t stream) {
  char* ws = static_cast<char*>(workspace);
  int* counters = reinterpret_cast<int*>(ws + plan.counters_at);
  GroupAdvantagesArgs<T> a;
  a.p = p;
  a.rewards = rewards;
  a.weights = weights;
  a.batch = batch;
  a.num_groups = num_groups;
  a.groups.group_size = p.group_size;
  a.team_width = plan.team_width;
  a.team_shift = plan.team_shift;
  a.tiles = plan.tiles;
  a.adv = adv;
  a.group_mean = group_mean;
  a.group_std = group_std;
  a.zero_std = zero_std;
  if (plan.batch_statistics) {
    a.tile_moments = reinterpret_cast<double*>(ws + plan.tile_moments_at);
    a.batch_moments = reinterpret_cast<double*>(ws + plan.batch_moments_at);
    a.exponents = reinterpret_cast<int*>(ws + plan.exponents_at);
    a.blocks_done = counters + 1;
  }
  // Zero the finished-block counters and (group_ids) the group counts in one memset: they are contiguous.
  if (plan.batch_statistics || plan.indexed) {
    const int64_t end = plan.indexed ? plan.cursor_at : plan.offsets_at;
    const cudaError_t status = cudaMemsetAsync(counters, 0, size_t(end - plan.counters_at), stream);
    if (status != cudaSuccess) return status;
  }
  const unsigned tiles = static_cast<unsigned>(plan.tiles > 0 ? plan.tiles : 1);
  if (plan.indexed) {
    int* offsets = reinterpret_cast<int*>(ws + plan.offsets_at);
    int* cursor = reinterpret_cast<int*>(ws + plan.cursor_at);
    int* placed = reinterpret_cast<int*>(ws + plan.placed_at);
    const int64_t row_blocks = (batch + 1023) / 1024;
    const unsigned blocks = static_cast<unsigned>(row_blocks > 0 ? row_blocks : 1);
    GRPO_LAUNCH(blocks, 1024, 0, stream, group_rows_count_kernel)(group_ids, id_stride, batch, num_groups, offsets,
                                                                  cursor, counters);
    GRPO_LAUNCH(blocks, 1024, 0, stream, group_rows_place_kernel)(group_ids, id_stride, batch, num_groups, cursor,
                                                                  placed);
    a.groups.offsets = offsets;
    a.groups.members = reinterpret_cast<int*>(ws + plan.members_at);
    a.groups.placed = placed;
  }
  GRPO_LAUNCH(tiles, plan.threads, 0, stream, group_advantages_kernel<T>)(a);
  if (plan.batch_statistics) {
    a.groups.placed = nullptr;  // the members are sorted now
    GRPO_LAUNCH(tiles, plan.threads, 0, stream, group_advantages_scale_kernel<T>)(a);
  }
  return cudaSuccess;
}

}  // namespace grpo_ext
