// What the CUDA bindings need from torch, on the stable ABI: the device guard, torch's current stream on that
// device, and CUDA error checks. The CUDA runtime is linked statically (CMakeLists.txt), so these calls never
// depend on the CUDA runtime that the user's torch ships.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>

#include "../plan/stable_api.h"

namespace grpo_ext {

inline void check_cuda_status(cudaError_t status, const char* what) {
  GRPO_CHECK(status == cudaSuccess, "grpo_ext: ", what, " failed: ", cudaGetErrorString(status));
}

#define GRPO_CUDA_CHECK(expr) ::grpo_ext::check_cuda_status((expr), #expr)

// After every launch: a launch error (bad configuration, no kernel image for this GPU) is reported at once.
inline void check_launch() {
  check_cuda_status(cudaGetLastError(), "kernel launch");
}

// The device of a CUDA op's input `t`, made current for the call, and torch's current stream on it (no sync).
class CudaCall {
 public:
  CudaCall(const Tensor& t, const char* name)
      : device_(checked_index(t, name)), guard_(device_), stream_(current_stream(device_)) {}

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

  int attribute(cudaDeviceAttr attr) const {
    int value = 0;
    GRPO_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device_));
    return value;
  }

 private:
  static int checked_index(const Tensor& t, const char* name) {
    GRPO_CHECK(t.is_cuda(), name, " must be a CUDA tensor for the CUDA kernel");
    return t.get_device_index();
  }

  static cudaStream_t current_stream(int device) {
    void* stream = nullptr;
    GRPO_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
               "grpo_ext: cannot get torch's current CUDA stream on device ", device);
    return static_cast<cudaStream_t>(stream);
  }

  int device_;
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_;
};

}  // namespace grpo_ext
