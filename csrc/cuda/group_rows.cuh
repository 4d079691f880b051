// Which rows form each group of group_advantages (csrc/cuda/group_advantages.cuh): contiguous runs of group_size
// rows, or lists built from group_ids by two kernels (a count with its prefix sum, then a place) and put into row
// order by each group's team. On raw pointers (no torch types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launch.cuh"
#include "reduce.cuh"

namespace grpo_ext {

// The rows of the groups: contiguous runs of group_size rows, or lists built from group_ids.
struct GroupRows {
  int64_t group_size = 1;        // contiguous groups
  const int* offsets = nullptr;  // [num_groups + 1]: group g is members[offsets[g] .. offsets[g + 1])
  int* members = nullptr;        // [B], each group's rows in increasing order
  const int* placed = nullptr;   // [B], each group's rows in any order: the main kernel sorts them into members
  __device__ __forceinline__ int64_t begin(int64_t g) const { return offsets ? offsets[g] : g * group_size; }
  __device__ __forceinline__ int64_t count(int64_t g) const {
    return offsets ? offsets[g + 1] - offsets[g] : group_size;
  }
  __device__ __forceinline__ int64_t row(int64_t position) const { return members ? members[position] : position; }
};

// The teams' layout in a block of the launcher's size (the same in every kernel of a call).
struct TeamLayout {
  int width, lane, team, teams;
  __device__ __forceinline__ TeamLayout(int team_width, int team_shift)
      : width(team_width),
        lane(static_cast<int>(threadIdx.x) & (team_width - 1)),
        team(static_cast<int>(threadIdx.x) >> team_shift),
        teams(static_cast<int>(blockDim.x) >> team_shift) {}
};

// The count pass of group_ids: rows per group by integer atomics into offsets[1 ..] (zeroed before), then the
// last block to finish turns the counts into offsets (an inclusive scan of offsets[1 .. num_groups]) and cursor
// (where each group's rows start). The scan runs over batches of kScanBatch x blockDim.x consecutive groups: each
// thread loads its run of kScanBatch groups' counts (all in flight at once, from L2 where the atomics left them) and
// adds them up, one block scan of the runs' totals places each run, and the thread writes its run's offsets. One
// block scan a batch, 4 for 65536 groups: one a tile of blockDim.x groups (64 there) took most of the 122 us of a
// 65536 x 8 call on an H200 (benchmarks/NOTES.md, "group_ids: one block scan a batch"), and a thread walking its own
// chunk with dependent loads and a serial scan of the chunks' totals took 250 us on an H100.
constexpr int kScanBatch = 16;
__global__ void __launch_bounds__(1024)
    group_rows_count_kernel(const int64_t* __restrict__ group_ids, int64_t id_stride, int64_t batch, int64_t num_groups,
                            int* __restrict__ offsets, int* __restrict__ cursor, int* __restrict__ blocks_done) {
  __shared__ int scratch[32];
  __shared__ bool last_block;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < batch; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = group_ids[i * id_stride];
    CUDA_KERNEL_ASSERT(id >= 0 && id < num_groups);
    if (id >= 0 && id < num_groups) atomicAdd(&offsets[id + 1], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's counts before its ticket
    last_block = atomicAdd(blocks_done, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  int carry = 0;  // the counts of the tiles before
  for (int64_t base = 0; base < num_groups; base += int64_t(kScanBatch) * blockDim.x) {
    const int64_t first = base + int64_t(threadIdx.x) * kScanBatch;  // this thread's run of groups
    int count[kScanBatch];
#pragma unroll
    for (int k = 0; k < kScanBatch; ++k) {
      const int64_t g = first + k;
      count[k] = g < num_groups ? __ldcg(offsets + 1 + g) : 0;  // past L1: other blocks' atomics wrote them
    }
    int run = 0;
#pragma unroll
    for (int k = 0; k < kScanBatch; ++k) run += count[k];
    int batch_total;
    int start = carry + block_inclusive_scan(run, scratch, batch_total) - run;  // the rows before this run
#pragma unroll
    for (int k = 0; k < kScanBatch; ++k) {
      const int64_t g = first + k;
      if (g < num_groups) {
        cursor[g] = start;
        start += count[k];
        offsets[1 + g] = start;
      }
    }
    carry += batch_total;
  }
}

// The place pass of group_ids: each row into its group's list (placed), in whatever order the atomics give.
__global__ void __launch_bounds__(1024)
    group_rows_place_kernel(const int64_t* __restrict__ group_ids, int64_t id_stride, int64_t batch, int64_t num_groups,
                            int* __restrict__ cursor, int* __restrict__ placed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < batch; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = group_ids[i * id_stride];
    if (id >= 0 && id < num_groups) placed[atomicAdd(&cursor[id], 1)] = static_cast<int>(i);
  }
}

// A team puts its group's rows (placed, any order) into members in increasing order: each row's rank among them.
__device__ __forceinline__ void sort_group_rows(const GroupRows& groups, int64_t base, int64_t n, const TeamLayout& t) {
  for (int64_t i = t.lane; i < n; i += t.width) {
    const int row = groups.placed[base + i];
    int64_t rank = 0;
    for (int64_t q = 0; q < n; ++q) rank += groups.placed[base + q] < row ? 1 : 0;
    groups.members[base + rank] = row;
  }
  __syncwarp();  // the team's other lanes read these members next
}

}  // namespace grpo_ext
