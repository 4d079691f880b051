// Kernels with one known bug each, a conversion kernel and a cluster kernel: tests/cuda_emu/test_runtime.py checks that
// the harness reports each bug (and converts as CUDA does, and runs clusters as a GPU does). Compiled like
// csrc/cuda/*.cuh: shared variables rewritten by build.py, launch bounds read from here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cluster.cuh"
#include "cuda/launch.cuh"

namespace selftest {

// Threads of one block take different barriers (a barrier inside a branch on threadIdx).
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Half of the block returns before a barrier the other half waits at.
__global__ void early_exit_barrier_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Warp 0 waits in a shuffle for lane 0, which waits at a barrier: neither can go on.
__global__ void deadlock_kernel(float* out) {
  float v = 1.0f;
  if (threadIdx.x == 0) __syncthreads();
  if (threadIdx.x != 0) v = __shfl_down_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// A shuffle over half a warp reads from the other half (lane + 16 is outside the mask).
__global__ void shuffle_outside_mask_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_down_sync(0x0000ffffu, v, 8);
  if (threadIdx.x < 16) v += __shfl_down_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

// A lane calls a shuffle with a mask that does not name it.
__global__ void lane_not_in_mask_kernel(float* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1.0f, 0);
}

// Thread 0 fills a shared value that the others read without a barrier: a race the schedules tell apart.
__global__ void missing_barrier_kernel(float* out) {
  __shared__ float value;
  if (threadIdx.x == 0) value = 2.0f;
  out[threadIdx.x] = value;
}

// Writes one element past a shared array.
__global__ void shared_overflow_kernel(float* out) {
  __shared__ float scratch[32];
  scratch[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = scratch[threadIdx.x];
}

// Reads one element past a device buffer.
__global__ void global_overflow_kernel(const float* in, float* out, int n) {
  out[threadIdx.x] = in[threadIdx.x + 1];
}

__global__ void device_assert_kernel(float* out) {
  CUDA_KERNEL_ASSERT(threadIdx.x < 8);
  out[threadIdx.x] = 1.0f;
}

__global__ void __launch_bounds__(64) bounded_kernel(float* out) {
  out[threadIdx.x] = 1.0f;
}

// Butterfly sums over every xor offset and width, up/down/idx shuffles, ballots and votes: each lane's results.
__global__ void warp_intrinsics_kernel(int* out) {
  const int lane = threadIdx.x & 31;
  int* o = out + threadIdx.x * 8;
  int x = lane;
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  o[0] = x;
  o[1] = __shfl_up_sync(0xffffffffu, lane, 3, 8);
  o[2] = __shfl_down_sync(0xffffffffu, lane, 5, 16);
  o[3] = __shfl_sync(0xffffffffu, lane * 10, lane + 7, 4);
  o[4] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = __any_sync(0xffffffffu, lane == 31);
  o[6] = __all_sync(0xffffffffu, lane < 31);
  __syncwarp();
  o[7] = lane < 16 ? __shfl_xor_sync(0x0000ffffu, lane, 1) : -1;
}

__global__ void convert_kernel(const float* in, __nv_bfloat16* bf16, __half* f16, float* back, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    bf16[i] = __float2bfloat16_rn(in[i]);
    f16[i] = __float2half_rn(in[i]);
    back[2 * i] = __bfloat162float(bf16[i]);
    back[2 * i + 1] = __half2float(f16[i]);
  }
}

// Thread-block clusters, correctly: each block fills its dynamic shared memory (`words` ints) and a static shared tag,
// then reads both neighbours' in its cluster through distributed shared memory, in a grid-stride loop over
// `clusters` clusters. Per block b (rank r of n): out[b][i] = {next block's word words-1-i, previous block's word i},
// info[b] = {r, n, next block's tag}, sums[b][t] = the sum of t + b over t's warp.
__global__ void cluster_exchange_kernel(int* out, int* info, int* sums, unsigned words, unsigned clusters) {
  __shared__ int tag;
  int* mine = grpo_ext::dynamic_shared<int>();
  const unsigned n = grpo_ext::cluster_num_blocks(), rank = grpo_ext::cluster_block_rank();
  const unsigned next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const unsigned warp = threadIdx.x / 32, lanes = blockDim.x - warp * 32 < 32 ? blockDim.x - warp * 32 : 32;
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;  // the warp's lanes (16 or 32 here)
  for (unsigned c = blockIdx.x / n; c < clusters; c += gridDim.x / n) {
    const unsigned block = c * n + rank;
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) mine[i] = static_cast<int>(block * 65536 + i);
    __syncthreads();
    if (threadIdx.x == 0) tag = mine[words - 1] - static_cast<int>(words - 1);  // another thread's word
    int sum = static_cast<int>(threadIdx.x + block);
    for (unsigned offset = 16; offset > 0; offset >>= 1) {
      if (offset < lanes) sum += __shfl_xor_sync(mask, sum, static_cast<int>(offset));
    }
    sums[block * blockDim.x + threadIdx.x] = sum;
    grpo_ext::cluster_sync();
    const int* right = grpo_ext::cluster_map_shared(mine, next);
    const int* left = grpo_ext::cluster_map_shared(mine, prev);
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) {
      out[(size_t(block) * words + i) * 2] = right[words - 1 - i];
      out[(size_t(block) * words + i) * 2 + 1] = left[i];
    }
    if (threadIdx.x == 0) {
      info[block * 3] = static_cast<int>(rank);
      info[block * 3 + 1] = static_cast<int>(n);
      info[block * 3 + 2] = *grpo_ext::cluster_map_shared(&tag, next);
    }
    grpo_ext::cluster_sync();  // the peers have read this block's shared memory: it may be refilled, or exit
  }
}

// mbarriers and pushes (cluster.cuh), in a grid-stride loop over `clusters` clusters: in each of `rounds` rounds,
// warp 0 of every block pushes the value block * 1000 + round into its slot (its rank) of every block's inbox of
// that round's parity, and thread 0 writes the sum of what landed once the slot set's mbarrier phase completes:
// out[round][block] = the sum over the blocks b of its cluster of b * 1000 + round. `bug` plants one mistake: 1 no
// cluster barrier after the mbarriers' initialization (a __syncthreads instead), 2 one value too few announced, 3 the
// inbox read without the wait, 4 rank 0 skips the wait of its last round (it may exit before the peers' pushes land).
struct alignas(16) MbarrierSlot {
  float value, pad[3];
};

__global__ void mbarrier_exchange_kernel(float* out, unsigned clusters, unsigned rounds, int bug) {
  __shared__ MbarrierSlot inbox[2][16];
  __shared__ grpo_ext::Mbarrier full[2];
  const unsigned n = grpo_ext::cluster_num_blocks(), rank = grpo_ext::cluster_block_rank();
  if (threadIdx.x == 0) {
    grpo_ext::mbarrier_init(&full[0], 1);
    grpo_ext::mbarrier_init(&full[1], 1);
  }
  if (bug == 1) {
    __syncthreads();
  } else {
    grpo_ext::cluster_sync_mbarrier_init();
  }
  unsigned p = 0, phases = 0;  // the slot set a round uses, and each set's mbarrier phase parity
  for (unsigned c = blockIdx.x / n; c < clusters; c += gridDim.x / n) {
    const unsigned block = c * n + rank;
    for (unsigned round = 0; round < rounds; ++round) {
      if (threadIdx.x < 32) {
        const unsigned announced = bug == 2 ? n - 1 : n;
        if (threadIdx.x == 0) grpo_ext::mbarrier_arrive_expect_tx(&full[p], announced * unsigned(sizeof(MbarrierSlot)));
        const MbarrierSlot mine{static_cast<float>(block * 1000 + round), {0.0f, 0.0f, 0.0f}};
        if (threadIdx.x < n) grpo_ext::cluster_push(&inbox[p][rank], threadIdx.x, mine, &full[p]);
        const bool last = c + gridDim.x / n >= clusters && round + 1 == rounds;
        if (bug != 3 && !(bug == 4 && rank == 0 && last)) grpo_ext::mbarrier_wait(&full[p], (phases >> p) & 1u);
        if (threadIdx.x == 0) {
          float sum = 0.0f;
          for (unsigned k = 0; k < n; ++k) sum += inbox[p][k].value;
          out[size_t(round) * clusters * n + block] = sum;
        }
      }
      phases ^= 1u << p;
      p ^= 1u;
      __syncthreads();
    }
  }
}

// Fills its dynamic shared memory (`blockDim.x` floats at least) and a static shared flag; never allowed more than
// 48 KiB (GRPO_ALLOW_DYNAMIC_SHARED is not called for it anywhere).
__global__ void dynamic_fill_kernel(float* out) {
  __shared__ float flag;
  float* mine = grpo_ext::dynamic_shared<float>();
  mine[threadIdx.x] = 1.0f;
  if (threadIdx.x == 0) flag = 1.0f;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = mine[threadIdx.x] * flag;
}

// Writes one element past its dynamic shared memory (`blockDim.x` floats).
__global__ void dynamic_shared_overflow_kernel(float* out) {
  float* mine = grpo_ext::dynamic_shared<float>();
  mine[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = mine[threadIdx.x];
}

// Reads its dynamic shared memory before any thread wrote it (NaN, as a fresh block's on the emulated device).
__global__ void dynamic_shared_unwritten_kernel(float* out) {
  const float* mine = grpo_ext::dynamic_shared<float>();
  CUDA_KERNEL_ASSERT(reinterpret_cast<uintptr_t>(mine) % 16 == 0);
  out[threadIdx.x] = mine[threadIdx.x];
}

// Cluster bugs (a cluster of 2 blocks or more; `blockDim.x` floats of dynamic shared memory):
// each block reads its neighbour's shared memory with no cluster_sync before it exits, through a pointer mapped while
// the neighbour was alive: a block that exits first frees what the other still reads.
__global__ void missing_final_cluster_sync_kernel(float* out) {
  float* mine = grpo_ext::dynamic_shared<float>();
  const float* right = grpo_ext::cluster_map_shared(mine, (grpo_ext::cluster_block_rank() + 1) % 2);
  mine[threadIdx.x] = static_cast<float>(blockIdx.x);
  grpo_ext::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] = right[threadIdx.x];
}

// The same, the neighbour's address mapped after the barrier (after it may have exited).
__global__ void map_after_exit_kernel(float* out) {
  float* mine = grpo_ext::dynamic_shared<float>();
  mine[threadIdx.x] = static_cast<float>(blockIdx.x);
  grpo_ext::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] =
      grpo_ext::cluster_map_shared(mine, (grpo_ext::cluster_block_rank() + 1) % 2)[threadIdx.x];
}

// Rank 0 and the others take different cluster barriers.
__global__ void divergent_cluster_sync_kernel(float* out) {
  if (grpo_ext::cluster_block_rank() == 0) {
    grpo_ext::cluster_sync();
  } else {
    grpo_ext::cluster_sync();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// Rank 1 exits while rank 0 waits at a cluster barrier.
__global__ void early_exit_cluster_sync_kernel(float* out) {
  if (grpo_ext::cluster_block_rank() == 1) return;
  grpo_ext::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// Half of each block waits at __syncthreads, the other half at cluster_sync: two different barriers.
__global__ void mixed_barriers_kernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    grpo_ext::cluster_sync();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// cluster_map_shared of a global-memory pointer.
__global__ void map_global_kernel(float* out) {
  grpo_ext::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] = *grpo_ext::cluster_map_shared(out, 0);
  grpo_ext::cluster_sync();
}

// cluster_map_shared to a rank past the cluster's last block.
__global__ void map_rank_out_of_range_kernel(float* out) {
  float* mine = grpo_ext::dynamic_shared<float>();
  mine[threadIdx.x] = 1.0f;
  grpo_ext::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] =
      grpo_ext::cluster_map_shared(mine, grpo_ext::cluster_num_blocks())[threadIdx.x];
  grpo_ext::cluster_sync();
}

}  // namespace selftest
