// The one place the bindings meet torch: the LibTorch stable ABI (torch/csrc/stable, torch/headeronly), so that one
// binary runs under every torch from TORCH_TARGET_VERSION on (CMakeLists.txt sets it; docs/architecture.md says
// why that version). No at:: or c10:: symbol may be referenced from here on: `make abi-audit` checks the binary.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <array>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace grpo_ext {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using BFloat16 = torch::headeronly::BFloat16;
using Half = torch::headeronly::Half;

// The argument's own message, as TORCH_CHECK gave it to Python (RuntimeError): STD_TORCH_CHECK would prefix every
// message with the C++ function, file and line, which tell a user nothing about their call.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  ((message << args), ...);
  throw std::runtime_error(message.str());
}

#define GRPO_CHECK(cond, ...)                   \
  do {                                          \
    if (!(cond)) ::grpo_ext::fail(__VA_ARGS__); \
  } while (false)

// Printable shapes, strides and devices for the error messages: [2, 3], cuda:0.
struct Dims {
  torch::headeronly::IntHeaderOnlyArrayRef values;
};
inline std::ostream& operator<<(std::ostream& out, const Dims& d) {
  out << '[';
  for (size_t i = 0; i < d.values.size(); ++i) out << (i ? ", " : "") << d.values[i];
  return out << ']';
}
inline Dims shape(const Tensor& t) {
  return {t.sizes()};
}
inline Dims strides(const Tensor& t) {
  return {t.strides()};
}

struct DeviceName {
  torch::stable::Device device;
};
inline std::ostream& operator<<(std::ostream& out, const DeviceName& d) {
  out << (d.device.is_cuda() ? "cuda" : d.device.is_cpu() ? "cpu" : "device");
  if (d.device.has_index() && !d.device.is_cpu()) out << ':' << int(d.device.index());
  return out;
}
inline DeviceName device_name(const Tensor& t) {
  return {t.device()};
}
inline bool same_shape(const Tensor& a, const Tensor& b) {
  return a.sizes().equals(b.sizes());
}
inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.device() == b.device();
}

inline bool is_integral(ScalarType t) {
  return t == ScalarType::Byte || t == ScalarType::Char || t == ScalarType::Short || t == ScalarType::Int ||
         t == ScalarType::Long;
}

// The strides of a contiguous tensor of `sizes` (at most 8 dimensions) into `strides`; returns its element count.
inline int64_t contiguous_strides(torch::headeronly::IntHeaderOnlyArrayRef sizes, int64_t (&strides)[8]) {
  GRPO_CHECK(sizes.size() <= 8, "grpo_ext: at most 8 dimensions, got ", sizes.size());
  int64_t stride = 1, numel = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;
    numel *= sizes[d];
  }
  return numel;
}

// A new contiguous tensor on `like`'s device. aoti_torch_empty_strided allocates without a trip through the
// dispatcher (torch::stable::new_empty boxes a call to aten::new_empty: ~1.5 us each, four per op call).
inline Tensor new_empty(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes, ScalarType dtype) {
  const size_t dim = sizes.size();
  int64_t strides[8];
  contiguous_strides(sizes, strides);
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle handle = nullptr;
  const bool ok = aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_get_device_index(like.get(), &device_index) == AOTI_TORCH_SUCCESS &&
                  aoti_torch_empty_strided(static_cast<int64_t>(dim), sizes.data(), strides,
                                           torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype)),
                                           device_type, device_index, &handle) == AOTI_TORCH_SUCCESS;
  GRPO_CHECK(ok, "grpo_ext: allocating a tensor of shape ", Dims{sizes}, " failed");
  return Tensor(handle);
}

// An aten op the stable wrappers of the oldest supported torch do not cover, called through the dispatcher (a
// stable entry point since torch 2.10): `stack` holds the arguments and receives the outputs.
template <size_t N>
void call_aten(const char* op, const char* overload, std::array<StableIValue, N>& stack) {
  const AOTITorchError err = torch_call_dispatcher(op, overload, stack.data(), TORCH_ABI_VERSION);
  GRPO_CHECK(err == AOTI_TORCH_SUCCESS, "grpo_ext: the dispatcher call to ", op, " failed");
}

// self *= other (aten::mul_.Tensor: other broadcasts, and is cast to self's dtype as at::mul_ does).
inline void mul_(const Tensor& self, const Tensor& other) {
  std::array<StableIValue, 2> stack{torch::stable::detail::from(self), torch::stable::detail::from(other)};
  call_aten("aten::mul_", "Tensor", stack);
  // The returned alias of `self` is a new handle: release it.
  (void)torch::stable::detail::to<Tensor>(stack[0]);
}

// self * other (aten::mul.Tensor), a new tensor.
inline Tensor mul(const Tensor& self, const Tensor& other) {
  std::array<StableIValue, 2> stack{torch::stable::detail::from(self), torch::stable::detail::from(other)};
  call_aten("aten::mul", "Tensor", stack);
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// The contiguous `t` viewed with the contiguous shape `sizes` (as many elements), without a trip through the
// dispatcher.
inline Tensor view_contiguous(const Tensor& t, torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  const size_t dim = sizes.size();
  int64_t view_strides[8];
  const int64_t numel = contiguous_strides(sizes, view_strides);
  GRPO_CHECK(t.is_contiguous() && t.numel() == numel, "grpo_ext: cannot view ", shape(t), " as ", Dims{sizes});
  AtenTensorHandle handle = nullptr;
  GRPO_CHECK(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(dim), sizes.data(), view_strides,
                                            /*offset_increment=*/0, &handle) == AOTI_TORCH_SUCCESS,
             "grpo_ext: viewing a tensor as ", Dims{sizes}, " failed");
  return Tensor(handle);
}

inline bool is_inference(const Tensor& self) {
  std::array<StableIValue, 1> stack{torch::stable::detail::from(self)};
  call_aten("aten::is_inference", "", stack);
  return torch::stable::detail::to<bool>(stack[0]);
}

}  // namespace grpo_ext
