// The self-test kernels of selftest_kernels.cuh as ops: selftest_bug(name, threads) launches one buggy kernel in a
// single block; selftest_warp_intrinsics(threads) and selftest_convert(values) return what the kernels computed.
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
  } else if (name == "dynamic_shared") {
    GRPO_LAUNCH(1, threads, 128, nullptr, selftest::bounded_kernel)(o);
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

const RegisterOp kBug("selftest_bug", selftest_bug);
const RegisterOp kWarp("selftest_warp_intrinsics", selftest_warp_intrinsics);
const RegisterOp kConvert("selftest_convert", selftest_convert);

}  // namespace
}  // namespace cuda_emu
