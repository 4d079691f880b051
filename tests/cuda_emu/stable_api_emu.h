// cuda_emu's stand-in for csrc/plan/stable_api.h, the one place the plans meet torch: build.py writes it over
// plan/stable_api.h in its copy of csrc/, so that the plans (csrc/plan/*.h: checks, option parsing, views, output
// allocation, logits_loss' composition) run as they are on the driver's tensors. It offers what the plans use of
// torch's stable API, no more, over cuda_emu::Tensor: every tensor is on the one emulated device (a
// num_items_in_batch tensor included: the plans copy it to the accumulate type instead of reading it on the host),
// none is an inference tensor, and aten::mul and Tensor.to compute on the host what the device would (float32 or
// float64 arithmetic, no kernel of csrc/cuda involved).
#pragma once

#include <cstdint>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "driver.h"

namespace grpo_ext {

// torch's dtypes that the driver's tensors can hold (DType), with torch's names.
enum class ScalarType { Byte, Char, Short, Int, Long, Half, Float, Double, Bool, BFloat16 };

inline std::ostream& operator<<(std::ostream& out, ScalarType t) {
  constexpr const char* kNames[] = {"Byte", "Char",  "Short",  "Int",  "Long",
                                    "Half", "Float", "Double", "Bool", "BFloat16"};
  return out << kNames[static_cast<int>(t)];
}

namespace emu_detail {
constexpr std::pair<DType, ScalarType> kTypes[] = {
    {DType::kFloat32, ScalarType::Float},     {DType::kFloat64, ScalarType::Double},
    {DType::kBFloat16, ScalarType::BFloat16}, {DType::kFloat16, ScalarType::Half},
    {DType::kBool, ScalarType::Bool},         {DType::kUInt8, ScalarType::Byte},
    {DType::kInt8, ScalarType::Char},         {DType::kInt32, ScalarType::Int},
    {DType::kInt64, ScalarType::Long}};
inline ScalarType scalar_type_of(DType d) {
  for (const auto& [dtype, scalar] : kTypes) {
    if (dtype == d) return scalar;
  }
  cuda_emu::bad_args("a tensor of an unknown dtype");
}
inline DType dtype_of(ScalarType s) {
  for (const auto& [dtype, scalar] : kTypes) {
    if (scalar == s) return dtype;
  }
  cuda_emu::bad_args("the emulated device holds no tensor of this dtype");
}
}  // namespace emu_detail

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

// A driver tensor as the plans see a torch::stable::Tensor (default-constructed: undefined).
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(cuda_emu::Tensor t) : t_(std::move(t)), defined_(true) {}

  bool defined() const { return defined_; }
  const cuda_emu::Tensor& emu() const { return t_; }
  ScalarType scalar_type() const { return emu_detail::scalar_type_of(t_.dtype); }
  int64_t dim() const { return t_.dim(); }
  int64_t size(int64_t d) const { return t_.size(d); }
  int64_t stride(int64_t d) const { return t_.stride(d); }
  const std::vector<int64_t>& sizes() const { return t_.sizes; }
  const std::vector<int64_t>& strides() const { return t_.strides; }
  int64_t numel() const { return t_.numel(); }
  bool is_cpu() const { return false; }
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int64_t d = dim() - 1; d >= 0; --d) {
      if (size(d) != 1 && stride(d) != expected) return false;
      expected *= size(d);
    }
    return true;
  }
  // torch's: null for a tensor without elements.
  void* data_ptr() const { return numel() == 0 ? nullptr : t_.data(); }
  template <typename T>
  T* mutable_data_ptr() const {
    return static_cast<T*>(data_ptr());
  }
  template <typename T>
  const T* const_data_ptr() const {
    return static_cast<const T*>(data_ptr());
  }

 private:
  cuda_emu::Tensor t_;
  bool defined_ = false;
};

struct Dims {
  std::vector<int64_t> values;
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

struct DeviceName {};
inline std::ostream& operator<<(std::ostream& out, const DeviceName&) {
  return out << "cuda:0";
}
inline DeviceName device_name(const Tensor&) {
  return {};
}
inline bool same_shape(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes();
}
inline bool same_device(const Tensor&, const Tensor&) {
  return true;
}

inline bool is_integral(ScalarType t) {
  return t == ScalarType::Byte || t == ScalarType::Char || t == ScalarType::Short || t == ScalarType::Int ||
         t == ScalarType::Long;
}

inline Tensor new_empty(const Tensor&, const std::vector<int64_t>& sizes, ScalarType dtype) {
  return Tensor(cuda_emu::empty(sizes, emu_detail::dtype_of(dtype)));
}

// self * other for a float32 or float64 `self` and a one-element `other` (what the plans multiply).
inline Tensor mul(const Tensor& self, const Tensor& other) {
  GRPO_CHECK(self.is_contiguous() && other.numel() == 1 && self.scalar_type() == other.scalar_type() &&
                 (self.scalar_type() == ScalarType::Float || self.scalar_type() == ScalarType::Double),
             "cuda_emu's mul: a contiguous float32 or float64 tensor by a one-element one of its dtype");
  Tensor out = new_empty(self, self.sizes(), self.scalar_type());
  for (int64_t i = 0; i < self.numel(); ++i) {
    if (self.scalar_type() == ScalarType::Double) {
      out.mutable_data_ptr<double>()[i] = self.const_data_ptr<double>()[i] * other.const_data_ptr<double>()[0];
    } else {
      out.mutable_data_ptr<float>()[i] = self.const_data_ptr<float>()[i] * other.const_data_ptr<float>()[0];
    }
  }
  return out;
}

// The contiguous `t` viewed with the contiguous shape `sizes` (as many elements): the same storage.
inline Tensor view_contiguous(const Tensor& t, const std::vector<int64_t>& sizes) {
  cuda_emu::Tensor view = t.emu();
  view.sizes = sizes;
  view.strides.assign(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) view.strides[d - 1] = view.strides[d] * sizes[d];
  GRPO_CHECK(t.is_contiguous() && view.numel() == t.numel(), "grpo_ext: cannot view ", shape(t), " as ", Dims{sizes});
  return Tensor(std::move(view));
}

inline bool is_inference(const Tensor&) {
  return false;
}

}  // namespace grpo_ext

namespace torch::stable {

// reshape(t, {1}) of a one-element tensor (the plans' only reshape).
inline grpo_ext::Tensor reshape(const grpo_ext::Tensor& t, const std::vector<int64_t>& sizes) {
  GRPO_CHECK(t.numel() == 1 && sizes == std::vector<int64_t>{1}, "cuda_emu's reshape: a one-element tensor to [1]");
  cuda_emu::Tensor view = t.emu();
  view.sizes = {1};
  view.strides = {1};
  return grpo_ext::Tensor(std::move(view));
}

// A one-element tensor converted to float32 or float64 (the plans' only conversion: num_items_in_batch).
inline grpo_ext::Tensor to(const grpo_ext::Tensor& t, grpo_ext::ScalarType dtype) {
  GRPO_CHECK(t.numel() == 1 && (dtype == grpo_ext::ScalarType::Float || dtype == grpo_ext::ScalarType::Double),
             "cuda_emu's to: a one-element tensor to float32 or float64");
  return grpo_ext::Tensor(cuda_emu::scalar_tensor(t.emu().item(), grpo_ext::emu_detail::dtype_of(dtype)));
}

}  // namespace torch::stable
