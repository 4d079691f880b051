// cuda_emu has no cooperative groups: csrc/cuda/cluster.cuh reaches for them only when GRPO_CLUSTER_API is not defined
// yet, i.e. when it is included before <cuda_runtime.h> (../runtime.h defines it, and the harness's own versions of
// cluster.cuh's functions).
#pragma once

#error "cuda_emu: include <cuda_runtime.h> before cuda/cluster.cuh (the harness's runtime.h defines GRPO_CLUSTER_API)"
