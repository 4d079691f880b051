// cuda_emu's driver: runs grpo_ext's raw ops (torch.ops.grpo_ext.*, same arguments, same outputs) through the CUDA
// launchers of csrc/cuda/*.cuh on the emulated device, for tests/cuda_emu/client.py. The loss ops (grpo_loss_forward,
// the logits pass and grpo_loss_from_logits) run their host plans, csrc/plan/*.h, as they are (plans.h); the other
// ops_*.cpp mirror theirs without torch. Each mirrors its op's CUDA binding (csrc/cuda/<op>.cu): the same launcher
// template arguments and launch arguments, and the same output shapes and dtypes.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace cuda_emu {

using grpo_ext::DType;

DType dtype_from_name(const std::string& name);
const char* dtype_name(DType t);

// A tensor on the emulated device: one heap block holding exactly the elements its sizes and strides reach.
struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> sizes, strides;
  std::shared_ptr<unsigned char[]> storage;
  size_t nbytes = 0;

  int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
  int64_t size(int64_t d) const { return sizes.at(d < 0 ? d + dim() : d); }
  int64_t stride(int64_t d) const { return strides.at(d < 0 ? d + dim() : d); }
  int64_t numel() const;
  void* data() const { return storage.get(); }
  template <typename T>
  T* data_as() const {
    return reinterpret_cast<T*>(storage.get());
  }
  // Element 0 as a double (a one-element tensor's value).
  double item() const;
};

// A fresh contiguous tensor filled with 0xff bytes (NaN in every float type), like an at::empty that shows reads of
// elements the kernels never wrote.
Tensor empty(const std::vector<int64_t>& sizes, DType dtype);
// A one-element tensor holding `value` in `dtype` (float32 or float64): `t.reshape({1}).to(dtype)` on the device.
Tensor scalar_tensor(double value, DType dtype);

// One argument of an op call, as the schema types it.
struct Value {
  enum class Kind { kNone, kTensor, kInt, kFloat, kBool, kString, kDType } kind = Kind::kNone;
  Tensor tensor;
  int64_t i = 0;
  double f = 0.0;
  std::string s;
  DType dtype = DType::kFloat32;
};

// An op's arguments in schema order, read one at a time with the type the schema gives them.
class Args {
 public:
  Args(std::string op, std::vector<Value> values) : op_(std::move(op)), values_(std::move(values)) {}
  const Tensor& tensor();
  std::optional<Tensor> optional_tensor();
  int64_t integer();
  double number();
  std::optional<double> optional_number();
  bool boolean();
  const std::string& string();  // the request's own: it lives as long as the Args
  DType dtype();
  void done() const;  // every argument was read

 private:
  const Value& next(Value::Kind kind, const char* what);
  std::string op_;
  std::vector<Value> values_;
  size_t pos_ = 0;
};

[[noreturn]] void bad_args(const std::string& message);

// StridedMatrix views and LogitsRows, built by the code the plans use (common.h's strided_matrix_of and
// logits_rows_of).
grpo_ext::StridedMatrix matrix_view(const Tensor& t, int64_t rows, int64_t cols, bool allow_row_vector);
grpo_ext::LogitsRows logits_rows(const Tensor& logits);
DType accumulate_type(DType t);  // float64 for float64, float32 otherwise

using Op = std::vector<Tensor> (*)(Args&);
// The ops of each ops_*.cpp: {"name", function}.
std::map<std::string, Op>& op_table();
struct RegisterOp {
  RegisterOp(const char* name, Op op) { op_table()[name] = op; }
};

}  // namespace cuda_emu
