// The self-test kernels of selftest_kernels.cuh as ops: selftest_bug(name, threads) launches one buggy kernel in a
// single block, selftest_cluster_bug(name, cluster_blocks, threads) one in a cluster;
// selftest_warp_intrinsics(threads), selftest_convert(values) and selftest_cluster(...) return what the kernels
// computed, selftest_device_limits() the emulated device's limits.
#include "driver.h"
#include "harness/selftest_kernels.cuh"  // the copy build.py rewrote

namespace cuda_emu {
namespace {

std::vector<Tensor> selftest_bug(Args& a) {
  const std::string name = a.string();
  const unsigned threads = static_cast<unsigned>(a.integer());
  a.done();
  Tensor out = empty({threads}, DType::kFloat32);
  float* o = out.data_as<float>();
  if (name == "divergent_barrier") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::divergent_barrier_kernel)(o);
  } else if (name == "early_exit_barrier") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::early_exit_barrier_kernel)(o);
  } else if (name == "deadlock") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::deadlock_kernel)(o);
  } else if (name == "shuffle_outside_mask") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::shuffle_outside_mask_kernel)(o);
  } else if (name == "lane_not_in_mask") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::lane_not_in_mask_kernel)(o);
  } else if (name == "missing_barrier") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::missing_barrier_kernel)(o);
  } else if (name == "shared_overflow") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::shared_overflow_kernel)(o);
  } else if (name == "global_overflow") {
    const Tensor in = empty({threads}, DType::kFloat32);
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::global_overflow_kernel)(in.data_as<float>(), o, int(threads));
  } else if (name == "device_assert") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::device_assert_kernel)(o);
  } else if (name == "bounded") {
    GRPO_LAUNCH(1, threads, 0, nullptr, selftest::bounded_kernel)(o);
  } else if (name == "dynamic_shared_overflow") {
    GRPO_LAUNCH(1, threads, threads * sizeof(float), nullptr, selftest::dynamic_shared_overflow_kernel)(o);
  } else if (name == "dynamic_shared_unwritten") {  // not a bug the harness reports: it returns NaN
    GRPO_LAUNCH(1, threads, threads * sizeof(float), nullptr, selftest::dynamic_shared_unwritten_kernel)(o);
  } else if (name == "dynamic_shared_over_48k") {  // not allowed more (GRPO_ALLOW_DYNAMIC_SHARED)
    GRPO_LAUNCH(1, threads, 48 * 1024 + 16, nullptr, selftest::dynamic_fill_kernel)(o);
  } else if (name == "static_plus_dynamic_over_48k") {  // its __shared__ flag on top of 48 KiB of dynamic
    GRPO_LAUNCH(1, threads, 48 * 1024, nullptr, selftest::dynamic_fill_kernel)(o);
  } else if (name == "dynamic_shared_over_device") {  // an ordinary launch throws what a cluster launch returns
    GRPO_LAUNCH(1, threads, device_limits().max_shared_per_block + 16, nullptr, selftest::dynamic_fill_kernel)(o);
  } else {
    bad_args("unknown self-test kernel " + name);
  }
  return {out};
}

std::vector<Tensor> selftest_warp_intrinsics(Args& a) {
  const unsigned threads = static_cast<unsigned>(a.integer());
  a.done();
  Tensor out = empty({threads, 8}, DType::kInt32);
  GRPO_LAUNCH(1, threads, 0, nullptr, selftest::warp_intrinsics_kernel)(out.data_as<int>());
  return {out};
}

std::vector<Tensor> selftest_convert(Args& a) {
  const Tensor in = a.tensor();
  a.done();
  const int64_t n = in.numel();
  Tensor bf16 = empty({n}, DType::kBFloat16), f16 = empty({n}, DType::kFloat16), back = empty({n, 2}, DType::kFloat32);
  GRPO_LAUNCH(4, 128, 0, nullptr, selftest::convert_kernel)(in.data_as<float>(), bf16.data_as<__nv_bfloat16>(),
                                                            f16.data_as<__half>(), back.data_as<float>(), n);
  return {bf16, f16, back};
}

// selftest_cluster_bug(name, cluster_blocks, threads): one cluster of the buggy kernel `name`, with `threads` floats
// of dynamic shared memory per block; "pending_error" leaves a refused launch's error for cudaGetLastError.
std::vector<Tensor> selftest_cluster_bug(Args& a) {
  const std::string name = a.string();
  const unsigned blocks = static_cast<unsigned>(a.integer()), threads = static_cast<unsigned>(a.integer());
  a.done();
  Tensor out = empty({blocks, threads}, DType::kFloat32);
  float* o = out.data_as<float>();
  const size_t bytes = threads * sizeof(float);
  cudaError_t code = cudaSuccess;
  if (name == "missing_final_cluster_sync") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::missing_final_cluster_sync_kernel)(o);
  } else if (name == "map_after_exit") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::map_after_exit_kernel)(o);
  } else if (name == "divergent_cluster_sync") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::divergent_cluster_sync_kernel)(o);
  } else if (name == "early_exit_cluster_sync") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::early_exit_cluster_sync_kernel)(o);
  } else if (name == "mixed_barriers") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::mixed_barriers_kernel)(o);
  } else if (name == "map_global") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::map_global_kernel)(o);
  } else if (name == "map_rank_out_of_range") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, bytes, nullptr, selftest::map_rank_out_of_range_kernel)(o);
  } else if (name == "grid_not_multiple") {
    code = GRPO_LAUNCH_CLUSTER(blocks + 1, threads, blocks, bytes, nullptr, selftest::dynamic_fill_kernel)(o);
  } else if (name == "dynamic_shared_over_48k") {
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, 48 * 1024 + 16, nullptr, selftest::dynamic_fill_kernel)(o);
  } else if (name == "pending_error") {  // refused (over the device), and the error is not taken
    code = GRPO_LAUNCH_CLUSTER(blocks, threads, blocks, device_limits().max_shared_per_block + 16, nullptr,
                               selftest::dynamic_fill_kernel)(o);
    if (code != cudaSuccess) return {out};
  } else {
    bad_args("unknown self-test kernel " + name);
  }
  if (code != cudaSuccess) bad_args(std::string("the launch was refused: ") + cudaGetErrorString(cudaGetLastError()));
  return {out};
}

// cluster_exchange_kernel as another kernel, whose GRPO_ALLOW_NONPORTABLE_CLUSTER (it lasts for the process) leaves
// cluster_exchange_kernel's launch checks as they were.
void cluster_exchange_nonportable_kernel(int* out, int* info, int* sums, unsigned words, unsigned clusters) {
  selftest::cluster_exchange_kernel(out, info, sums, words, clusters);
}

// selftest_cluster(cluster_blocks, grid_blocks, threads, words, clusters, launch, allow_bytes): cluster_exchange_kernel
// over `clusters` clusters of `cluster_blocks` blocks with `words` ints of dynamic shared memory, launched with
// `grid_blocks` blocks by GRPO_LAUNCH_CLUSTER (launch "cluster"; "nonportable": cluster_exchange_nonportable_kernel
// after GRPO_ALLOW_NONPORTABLE_CLUSTER) or GRPO_LAUNCH ("plain"), after
// GRPO_ALLOW_DYNAMIC_SHARED(allow_bytes) when allow_bytes >= 0. Returns the error codes {allow, launch,
// cudaGetLastError() after}, and the kernel's out, info and sums (runtime.h's kernel comment).
std::vector<Tensor> selftest_cluster(Args& a) {
  const int64_t n = a.integer(), grid = a.integer(), threads = a.integer(), words = a.integer(), clusters = a.integer();
  const std::string launch = a.string();
  const int64_t allow_bytes = a.integer();
  a.done();
  Tensor codes = empty({3}, DType::kInt32), out = empty({clusters * n, words, 2}, DType::kInt32);
  Tensor info = empty({clusters * n, 3}, DType::kInt32), sums = empty({clusters * n, threads}, DType::kInt32);
  int* code = codes.data_as<int>();
  code[0] = allow_bytes < 0 ? cudaSuccess : GRPO_ALLOW_DYNAMIC_SHARED(allow_bytes, selftest::cluster_exchange_kernel);
  const size_t bytes = static_cast<size_t>(words) * sizeof(int);
  const auto args = std::make_tuple(out.data_as<int>(), info.data_as<int>(), sums.data_as<int>(), unsigned(words),
                                    unsigned(clusters));
  if (launch == "cluster") {
    code[1] =
        std::apply(GRPO_LAUNCH_CLUSTER(grid, threads, n, bytes, nullptr, selftest::cluster_exchange_kernel), args);
  } else if (launch == "nonportable") {
    if (allow_bytes >= 0) code[0] = GRPO_ALLOW_DYNAMIC_SHARED(allow_bytes, cluster_exchange_nonportable_kernel);
    code[1] = GRPO_ALLOW_NONPORTABLE_CLUSTER(cluster_exchange_nonportable_kernel);
    if (code[1] == cudaSuccess) {
      code[1] =
          std::apply(GRPO_LAUNCH_CLUSTER(grid, threads, n, bytes, nullptr, cluster_exchange_nonportable_kernel), args);
    }
  } else if (launch == "plain") {
    code[1] = std::apply(GRPO_LAUNCH(grid, threads, bytes, nullptr, selftest::cluster_exchange_kernel), args);
  } else {
    bad_args("launch must be cluster or plain");
  }
  code[2] = cudaGetLastError();
  return {codes, out, info, sums};
}

// selftest_mbarrier(cluster_blocks, clusters, rounds, bug): mbarrier_exchange_kernel over `clusters` clusters of
// 64 threads a block (clusters over 8 blocks allowed); its out, [rounds, clusters * cluster_blocks].
std::vector<Tensor> selftest_mbarrier(Args& a) {
  const int64_t n = a.integer(), clusters = a.integer(), rounds = a.integer(), bug = a.integer();
  a.done();
  Tensor out = empty({rounds, clusters * n}, DType::kFloat32);
  (void)GRPO_ALLOW_NONPORTABLE_CLUSTER(selftest::mbarrier_exchange_kernel);
  const cudaError_t code = GRPO_LAUNCH_CLUSTER(clusters * n, 64, n, 0, nullptr, selftest::mbarrier_exchange_kernel)(
      out.data_as<float>(), unsigned(clusters), unsigned(rounds), int(bug));
  if (code != cudaSuccess) bad_args(std::string("the launch was refused: ") + cudaGetErrorString(cudaGetLastError()));
  return {out};
}

// selftest_active_clusters(cluster_blocks, threads, shared_bytes, nonportable): GRPO_MAX_ACTIVE_CLUSTERS of a launch
// of cluster_exchange_kernel (nonportable: cluster_exchange_nonportable_kernel, allowed first); {error, clusters}.
std::vector<Tensor> selftest_active_clusters(Args& a) {
  const int64_t n = a.integer(), threads = a.integer(), bytes = a.integer();
  const bool nonportable = a.boolean();
  a.done();
  Tensor result = empty({2}, DType::kInt32);
  int* r = result.data_as<int>();
  r[1] = -1;
  if (nonportable) {
    if (bytes > 48 * 1024) (void)GRPO_ALLOW_DYNAMIC_SHARED(bytes, cluster_exchange_nonportable_kernel);
    (void)GRPO_ALLOW_NONPORTABLE_CLUSTER(cluster_exchange_nonportable_kernel);
    r[0] = GRPO_MAX_ACTIVE_CLUSTERS(&r[1], n, threads, n, bytes, nullptr, cluster_exchange_nonportable_kernel);
  } else {
    if (bytes > 48 * 1024) (void)GRPO_ALLOW_DYNAMIC_SHARED(bytes, selftest::cluster_exchange_kernel);
    r[0] = GRPO_MAX_ACTIVE_CLUSTERS(&r[1], n, threads, n, bytes, nullptr, selftest::cluster_exchange_kernel);
  }
  return {result};
}

std::vector<Tensor> selftest_device_limits(Args& a) {
  a.done();
  Tensor limits = empty({2}, DType::kInt64);
  limits.data_as<int64_t>()[0] = static_cast<int64_t>(device_limits().max_shared_per_block);
  limits.data_as<int64_t>()[1] = device_limits().max_cluster_blocks;
  return {limits};
}

const RegisterOp kBug("selftest_bug", selftest_bug);
const RegisterOp kClusterBug("selftest_cluster_bug", selftest_cluster_bug);
const RegisterOp kCluster("selftest_cluster", selftest_cluster);
const RegisterOp kMbarrier("selftest_mbarrier", selftest_mbarrier);
const RegisterOp kLimits("selftest_device_limits", selftest_device_limits);
const RegisterOp kActiveClusters("selftest_active_clusters", selftest_active_clusters);
const RegisterOp kWarp("selftest_warp_intrinsics", selftest_warp_intrinsics);
const RegisterOp kConvert("selftest_convert", selftest_convert);

}  // namespace
}  // namespace cuda_emu
