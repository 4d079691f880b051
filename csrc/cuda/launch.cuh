// What the kernel headers take from outside C++ and CUDA, as macros, so that the headers compile as plain C++ too:
// tests/cuda_emu (the CPU execution harness) defines each of them before it includes the headers.
#pragma once

// GRPO_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...) launches kernel<<<grid, block, shared_bytes,
// stream>>>(args...). The kernel comes last because its template arguments may hold commas.
#ifndef GRPO_LAUNCH
#define GRPO_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif

// The launch configuration of a cluster launch (cudaLaunchKernelEx, cudaOccupancyMaxActiveClusters): `cluster_blocks`
// consecutive blocks along x, no cluster attribute for 1 (an ordinary launch). Used by the two macros below.
#if !defined(GRPO_LAUNCH_CLUSTER) || !defined(GRPO_MAX_ACTIVE_CLUSTERS)
#include <cuda_runtime.h>

namespace grpo_ext::launch_detail {
struct ClusterConfig {
  cudaLaunchAttribute cluster[1];
  cudaLaunchConfig_t config = {};

  ClusterConfig(dim3 grid, dim3 block, unsigned cluster_blocks, size_t shared_bytes, cudaStream_t stream) {
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = cluster_blocks;
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = cluster;
    config.numAttrs = cluster_blocks > 1 ? 1 : 0;
  }
  ClusterConfig(const ClusterConfig&) = delete;  // config.attrs points into this object
};
}  // namespace grpo_ext::launch_detail
#endif

// GRPO_LAUNCH_CLUSTER(grid, block, cluster_blocks, shared_bytes, stream, kernel)(args...) launches kernel with
// thread-block clusters of `cluster_blocks` consecutive blocks along x (sm_90; 1: an ordinary launch; grid.x must be
// a multiple of it) and returns the launch's cudaError_t, so that the launcher can fall back to another kernel when
// the device refuses the cluster (too little shared memory per GPC, or a GPU before sm_90).
#ifndef GRPO_LAUNCH_CLUSTER
#include <utility>

namespace grpo_ext::launch_detail {
template <typename... P>
struct ClusterLaunch {
  void (*kernel)(P...);
  dim3 grid, block;
  unsigned cluster_blocks;
  size_t shared_bytes;
  cudaStream_t stream;

  template <typename... A>
  cudaError_t operator()(A&&... args) const {
    const ClusterConfig launch(grid, block, cluster_blocks, shared_bytes, stream);
    return cudaLaunchKernelEx(&launch.config, kernel, std::forward<A>(args)...);
  }
};
template <typename... P>
ClusterLaunch(void (*)(P...), dim3, dim3, unsigned, size_t, cudaStream_t) -> ClusterLaunch<P...>;
}  // namespace grpo_ext::launch_detail

#define GRPO_LAUNCH_CLUSTER(grid, block, cluster_blocks, shared_bytes, stream, ...)                            \
  ::grpo_ext::launch_detail::ClusterLaunch {                                                                   \
    &__VA_ARGS__, dim3(grid), dim3(block), static_cast<unsigned>(cluster_blocks), size_t(shared_bytes), stream \
  }
#endif

// GRPO_ALLOW_DYNAMIC_SHARED(bytes, kernel) lets kernel launch with up to `bytes` of dynamic shared memory (above the
// default 48 KiB: cudaFuncAttributeMaxDynamicSharedMemorySize); returns the cudaError_t.
#ifndef GRPO_ALLOW_DYNAMIC_SHARED
#define GRPO_ALLOW_DYNAMIC_SHARED(bytes, ...) \
  cudaFuncSetAttribute(&__VA_ARGS__, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes))
#endif

// GRPO_ALLOW_NONPORTABLE_CLUSTER(kernel) lets kernel launch with clusters over the portable 8 blocks (up to 16 on
// sm_90: cudaFuncAttributeNonPortableClusterSizeAllowed); returns the cudaError_t.
#ifndef GRPO_ALLOW_NONPORTABLE_CLUSTER
#define GRPO_ALLOW_NONPORTABLE_CLUSTER(...) \
  cudaFuncSetAttribute(&__VA_ARGS__, cudaFuncAttributeNonPortableClusterSizeAllowed, 1)
#endif

// GRPO_MAX_ACTIVE_CLUSTERS(active, grid, block, cluster_blocks, shared_bytes, stream, kernel) sets *active to how
// many clusters of that launch the device can run at once (cudaOccupancyMaxActiveClusters; 0: none fits a GPC, the
// launch would fail) and returns the cudaError_t.
#ifndef GRPO_MAX_ACTIVE_CLUSTERS
namespace grpo_ext::launch_detail {
template <typename... P>
cudaError_t max_active_clusters(int* active, void (*kernel)(P...), dim3 grid, dim3 block, unsigned cluster_blocks,
                                size_t shared_bytes, cudaStream_t stream) {
  ClusterConfig launch(grid, block, cluster_blocks, shared_bytes, stream);
  launch.config.numAttrs = 1;  // the query takes the cluster attribute even for one block
  return cudaOccupancyMaxActiveClusters(active, reinterpret_cast<const void*>(kernel), &launch.config);
}
}  // namespace grpo_ext::launch_detail

#define GRPO_MAX_ACTIVE_CLUSTERS(active, grid, block, cluster_blocks, shared_bytes, stream, ...) \
  ::grpo_ext::launch_detail::max_active_clusters(active, &__VA_ARGS__, dim3(grid), dim3(block),  \
                                                 static_cast<unsigned>(cluster_blocks), size_t(shared_bytes), stream)
#endif

// ATen's device-side assert (torch/headeronly/macros/Macros.h, which the bindings include first); assert() where
// the headers are compiled without torch.
#ifndef CUDA_KERNEL_ASSERT
#include <cassert>
#define CUDA_KERNEL_ASSERT(cond) assert(cond)
#endif
