// cuda_emu's driver process: reads op calls on stdin, runs them on the emulated device, writes the outputs on stdout.
//
//   cuda_emu_driver --order forward|reverse|greedy-high|greedy-low --grid-cap N [--shared-per-block BYTES]
//                   [--max-cluster BLOCKS] [--max-nonportable-cluster BLOCKS] [--shared-per-sm BYTES]
//                   [--gpc-sms SMS]
//
// (--shared-per-block and --max-cluster set the emulated device's limits, runtime.h's DeviceLimits.)
// Request: a line "<op> <number of arguments>", then one line per argument (and, for a tensor, its bytes):
//   N | I <int> | F <float> | B <0|1> | S <string> | D <dtype> | T <dtype> <ndim> <sizes> <strides> <nbytes>
// Reply: "OK <number of outputs> <kernels launched>" and a T line plus bytes per output (an in-place op returns the
// tensor it wrote, over its whole span), or "ERR <message>" (a launch the harness refused, an invalid call, or an op
// that left a refused launch's error pending, which its binding's C10_CUDA_KERNEL_LAUNCH_CHECK would throw).
// A sanitizer report ends the process (the client reports it).
#include "driver.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "runtime.h"

namespace cuda_emu {

namespace {
constexpr std::pair<const char*, DType> kDTypeNames[] = {
    {"float32", DType::kFloat32}, {"float64", DType::kFloat64}, {"bfloat16", DType::kBFloat16},
    {"float16", DType::kFloat16}, {"bool", DType::kBool},       {"uint8", DType::kUInt8},
    {"int8", DType::kInt8},       {"int32", DType::kInt32},     {"int64", DType::kInt64}};
}  // namespace

DType dtype_from_name(const std::string& name) {
  for (const auto& [n, t] : kDTypeNames) {
    if (name == n) return t;
  }
  bad_args("unknown dtype " + name);
}

const char* dtype_name(DType t) {
  for (const auto& [n, d] : kDTypeNames) {
    if (d == t) return n;
  }
  return "?";
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

double Tensor::item() const {
  const grpo_ext::StridedMatrix m{data(), dtype, 0, 0};
  return m.load<double>(0, 0);
}

void bad_args(const std::string& message) {
  throw std::invalid_argument(message);
}

namespace {
int allocations = 0;  // tensors the running op allocated ("new<k>" buffers)

// Storage of `bytes` registered with the traffic counter under `label` (forgotten when freed).
std::shared_ptr<unsigned char[]> allocate(size_t bytes, const std::string& label) {
  std::shared_ptr<unsigned char[]> storage(new unsigned char[bytes], [](unsigned char* p) {
    forget_buffer(p);
    delete[] p;
  });
  register_buffer(storage.get(), bytes, label);
  return storage;
}
}  // namespace

Tensor empty(const std::vector<int64_t>& sizes, DType dtype) {
  Tensor t;
  t.dtype = dtype;
  t.sizes = sizes;
  t.strides.assign(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) t.strides[d] = t.strides[d + 1] * sizes[d + 1];
  t.nbytes = static_cast<size_t>(t.numel() * grpo_ext::dtype_bytes(dtype));
  t.storage = allocate(t.nbytes, "new" + std::to_string(allocations++));
  memset(t.storage.get(), 0xff, t.nbytes);
  return t;
}

Tensor scalar_tensor(double value, DType dtype) {
  Tensor t = empty({1}, dtype);
  if (dtype == DType::kFloat64) {
    *t.data_as<double>() = value;
  } else {
    *t.data_as<float>() = static_cast<float>(value);
  }
  return t;
}

DType accumulate_type(DType t) {
  return t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

grpo_ext::StridedMatrix matrix_view(const Tensor& t, int64_t rows, int64_t cols, bool allow_row_vector) {
  grpo_ext::StridedMatrix v;
  if (!grpo_ext::strided_matrix_of(t.data(), t.dtype, t.dim(), t.sizes.data(), t.strides.data(), rows, cols,
                                   allow_row_vector, &v)) {
    bad_args("a tensor does not have the shape its op expects");
  }
  return v;
}

grpo_ext::LogitsRows logits_rows(const Tensor& logits) {
  if (logits.dim() != 2 && logits.dim() != 3) bad_args("logits must be 2-D or 3-D");
  return grpo_ext::logits_rows_of(logits.data(), logits.dtype, logits.dim(), logits.sizes.data(),
                                  logits.strides.data());
}

std::map<std::string, Op>& op_table() {
  static std::map<std::string, Op> table;
  return table;
}

const Value& Args::next(Value::Kind kind, const char* what) {
  if (pos_ >= values_.size()) bad_args(op_ + ": too few arguments");
  const Value& v = values_[pos_++];
  if (v.kind != kind) bad_args(op_ + ": argument " + std::to_string(pos_ - 1) + " must be " + what);
  return v;
}
const Tensor& Args::tensor() {
  return next(Value::Kind::kTensor, "a tensor").tensor;
}
std::optional<Tensor> Args::optional_tensor() {
  if (pos_ < values_.size() && values_[pos_].kind == Value::Kind::kNone) {
    ++pos_;
    return std::nullopt;
  }
  return tensor();
}
int64_t Args::integer() {
  return next(Value::Kind::kInt, "an int").i;
}
double Args::number() {
  if (pos_ < values_.size() && values_[pos_].kind == Value::Kind::kInt) return static_cast<double>(integer());
  return next(Value::Kind::kFloat, "a float").f;
}
std::optional<double> Args::optional_number() {
  if (pos_ < values_.size() && values_[pos_].kind == Value::Kind::kNone) {
    ++pos_;
    return std::nullopt;
  }
  return number();
}
bool Args::boolean() {
  return next(Value::Kind::kBool, "a bool").i != 0;
}
const std::string& Args::string() {
  return next(Value::Kind::kString, "a string").s;
}
DType Args::dtype() {
  return next(Value::Kind::kDType, "a dtype").dtype;
}
void Args::done() const {
  if (pos_ != values_.size()) bad_args(op_ + ": too many arguments");
}

namespace {

bool read_line(std::string* line) {
  line->clear();
  int c;
  while ((c = std::getchar()) != EOF && c != '\n') line->push_back(static_cast<char>(c));
  return c != EOF || !line->empty();
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < line.size()) {
    const size_t j = line.find(' ', i);
    words.push_back(line.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return words;
}

Value read_value(int index) {
  std::string line;
  if (!read_line(&line)) bad_args("truncated request");
  const std::vector<std::string> w = split(line);
  Value v;
  const std::string& tag = w.at(0);
  if (tag == "N") return v;
  if (tag == "I") {
    v.kind = Value::Kind::kInt;
    v.i = std::stoll(w.at(1));
  } else if (tag == "F") {
    v.kind = Value::Kind::kFloat;
    v.f = std::strtod(w.at(1).c_str(), nullptr);
  } else if (tag == "B") {
    v.kind = Value::Kind::kBool;
    v.i = std::stoll(w.at(1));
  } else if (tag == "S") {
    v.kind = Value::Kind::kString;
    v.s = w.size() > 1 ? w[1] : "";
  } else if (tag == "D") {
    v.kind = Value::Kind::kDType;
    v.dtype = dtype_from_name(w.at(1));
  } else if (tag == "T") {
    v.kind = Value::Kind::kTensor;
    Tensor& t = v.tensor;
    t.dtype = dtype_from_name(w.at(1));
    const size_t ndim = std::stoul(w.at(2));
    for (size_t d = 0; d < ndim; ++d) t.sizes.push_back(std::stoll(w.at(3 + d)));
    for (size_t d = 0; d < ndim; ++d) t.strides.push_back(std::stoll(w.at(3 + ndim + d)));
    t.nbytes = std::stoull(w.at(3 + 2 * ndim));
    t.storage = allocate(t.nbytes, "arg" + std::to_string(index));
    if (std::fread(t.storage.get(), 1, t.nbytes, stdin) != t.nbytes) bad_args("truncated tensor");
  } else {
    bad_args("unknown argument tag " + tag);
  }
  return v;
}

void write_tensor(const Tensor& t) {
  std::string header = std::string("T ") + dtype_name(t.dtype) + " " + std::to_string(t.dim());
  for (int64_t s : t.sizes) header += " " + std::to_string(s);
  for (int64_t s : t.strides) header += " " + std::to_string(s);
  header += " " + std::to_string(t.nbytes) + "\n";
  std::fwrite(header.data(), 1, header.size(), stdout);
  std::fwrite(t.storage.get(), 1, t.nbytes, stdout);
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n') c = ' ';
  }
  return s;
}

Order parse_order(const std::string& s) {
  if (s == "forward") return Order::kForward;
  if (s == "reverse") return Order::kReverse;
  if (s == "greedy-high") return Order::kGreedyHigh;
  if (s == "greedy-low") return Order::kGreedyLow;
  std::cerr << "unknown order " << s << "\n";
  std::exit(2);
}

}  // namespace
}  // namespace cuda_emu

int main(int argc, char** argv) {
  using namespace cuda_emu;
  Schedule schedule;
  DeviceLimits limits;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--order") {
      schedule.order = parse_order(argv[i + 1]);
    } else if (flag == "--grid-cap") {
      schedule.grid_cap = static_cast<unsigned>(std::stoul(argv[i + 1]));
    } else if (flag == "--shared-per-block") {
      limits.max_shared_per_block = std::stoul(argv[i + 1]);
    } else if (flag == "--max-cluster") {
      limits.max_cluster_blocks = static_cast<unsigned>(std::stoul(argv[i + 1]));
      // a device with fewer than 8 takes no more with the non-portable attribute
      if (limits.max_cluster_blocks < 8) limits.max_nonportable_cluster_blocks = limits.max_cluster_blocks;
    } else if (flag == "--max-nonportable-cluster") {
      limits.max_nonportable_cluster_blocks = static_cast<unsigned>(std::stoul(argv[i + 1]));
    } else if (flag == "--shared-per-sm") {
      limits.shared_per_sm = std::stoul(argv[i + 1]);
    } else if (flag == "--gpc-sms") {
      limits.gpc_sms = static_cast<unsigned>(std::stoul(argv[i + 1]));
    } else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  set_schedule(schedule);
  set_device_limits(limits);
  std::string line;
  while (read_line(&line)) {
    std::string reply;
    std::vector<Tensor> outputs;
    try {
      const std::vector<std::string> w = split(line);
      const std::string op = w.at(0);
      const int n = std::stoi(w.at(1));
      std::vector<Value> values;
      allocations = 0;
      for (int i = 0; i < n; ++i) values.push_back(read_value(i));
      auto it = op_table().find(op);
      if (it == op_table().end()) bad_args("unknown op " + op);
      Args args(op, std::move(values));
      outputs = it->second(args);
      const std::string pending = take_pending_error();
      if (!pending.empty()) {
        throw std::runtime_error(op +
                                 " left a refused launch's error pending (cudaGetLastError() must take it after "
                                 "falling back; the binding's launch check would throw it): " +
                                 pending);
      }
      const std::string log = take_launch_log();
      reply = "OK " + std::to_string(outputs.size()) + " " + (log.empty() ? "-" : log) + "\n";
    } catch (const std::exception& e) {
      take_launch_log();
      take_traffic_log();
      take_pending_error();
      outputs.clear();
      reply = "ERR " + one_line(e.what()) + "\n";
    }
    std::fwrite(reply.data(), 1, reply.size(), stdout);
    for (const Tensor& t : outputs) write_tensor(t);
    if (reply[0] == 'O') {
      const std::string traffic = "TRAFFIC " + take_traffic_log() + "\n";
      std::fwrite(traffic.data(), 1, traffic.size(), stdout);
    }
    std::fflush(stdout);
  }
  return 0;
}
