// Between cuda_emu's scheduler (runtime.cpp) and its shared memory (shared_memory.cpp): the per-block storage of the
// running cluster, and the launch checks of dynamic shared memory and clusters against the emulated device.
#pragma once

#include <string>

#include "runtime.h"

namespace cuda_emu {

// Why the device cannot run `spec` (empty: it can). `refused` tells a launch the device's limits refuse (a GPU
// returns an error at launch time) from a bug that is always an error (a LaunchError).
std::string check_cluster_and_shared(const LaunchSpec& spec, bool* refused);
// Records a refused launch or attribute setting as the pending error (cudaGetLastError).
void set_pending_error(cudaError_t error, const std::string& what);

// Fresh shared memory for the `blocks` blocks of the cluster starting at block `first` of `spec`'s grid.
void begin_cluster(const LaunchSpec& spec, uint3 first, unsigned blocks);
// Block `rank`'s threads have all exited: its shared memory is gone (poisoned for ASan until end_cluster).
void block_exited(unsigned rank);
void end_cluster();  // frees the cluster's shared memory

// From the scheduler: the running thread's block in its cluster (fails outside a kernel), and the running
// thread's coordinates (nullptr outside a kernel).
unsigned running_block_rank();
const Coords* running_coords();

}  // namespace cuda_emu
