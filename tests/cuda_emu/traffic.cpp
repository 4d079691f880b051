// cuda_emu's traffic counter: the bytes each kernel launch reads and writes in every device buffer (the driver's
// tensors), for tests/cuda_emu/test_traffic.py and benchmarks/kernel_report.py.
//
// The traffic build (build.py, variant "traffic") compiles the kernels' translation units with GCC's
// -fsanitize=kernel-address and a call threshold of 0: every load and store the compiled code makes calls
// __asan_{load,store}{1,2,4,8,16,N}_noabort(address[, size]), defined here. An access inside a registered buffer, made
// while a launch runs, is added to that launch's count for the buffer; the rest (the fibers' stacks, i.e. a thread's
// registers, shared memory: static or dynamic, the block's own or a cluster peer's, the host code) is not global memory
// and is ignored. Per launch and buffer: the bytes read (every thread's loads: a value all threads of a block read
// counts once per thread, where a GPU serves it by one broadcast), the distinct bytes read (what an ideal cache would
// fetch) and the bytes written. Byte counts are exact; access widths are not (GCC may split a 16-byte copy into four
// 4-byte moves), so they are not reported.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime.h"

namespace cuda_emu {
namespace {

struct Buffer {
  uintptr_t end;
  std::string label;
};

struct Counts {
  uint64_t read = 0, written = 0;
  std::vector<bool> seen;  // the bytes read at least once, for `distinct`
  uint64_t distinct = 0;
};

struct Traffic {
  std::map<uintptr_t, Buffer> buffers;  // by start address
  bool counting = false;                // a launch runs
  std::string kernel;
  std::map<std::string, Counts> current;  // the running launch's, by buffer label
  std::string log;
};

Traffic& traffic() {
  static Traffic t;
  return t;
}

[[maybe_unused]] void count(uintptr_t address, uint64_t bytes, bool write) {
  Traffic& t = traffic();
  if (!t.counting || t.buffers.empty()) return;
  auto it = t.buffers.upper_bound(address);
  if (it == t.buffers.begin()) return;
  --it;
  if (address >= it->second.end) return;
  Counts& c = t.current[it->second.label];
  if (write) {
    c.written += bytes;
    return;
  }
  c.read += bytes;
  if (c.seen.empty()) c.seen.resize(it->second.end - it->first);
  for (uint64_t i = address - it->first, end = i + bytes; i < end && i < c.seen.size(); ++i) {
    if (!c.seen[i]) {
      c.seen[i] = true;
      ++c.distinct;
    }
  }
}

}  // namespace

void register_buffer(const void* base, size_t bytes, const std::string& label) {
  if (bytes == 0) return;
  const auto start = reinterpret_cast<uintptr_t>(base);
  traffic().buffers[start] = Buffer{start + bytes, label};
}

void forget_buffer(const void* base) {
  traffic().buffers.erase(reinterpret_cast<uintptr_t>(base));
}

void traffic_begin(const char* kernel) {
  Traffic& t = traffic();
  t.counting = true;
  t.kernel = kernel;
  t.current.clear();
}

void traffic_end() {
  Traffic& t = traffic();
  t.counting = false;
  std::string entry = t.kernel.substr(0, t.kernel.find('<'));
  for (const auto& [label, c] : t.current) {
    entry +=
        "|" + label + ":" + std::to_string(c.read) + ":" + std::to_string(c.distinct) + ":" + std::to_string(c.written);
  }
  t.log += (t.log.empty() ? "" : "\t") + entry;
}

std::string take_traffic_log() {
  std::string out;
  out.swap(traffic().log);
  return out;
}

}  // namespace cuda_emu

#if CUDA_EMU_TRAFFIC
// The callbacks of -fsanitize=kernel-address (recoverable: the _noabort names).
extern "C" {
#define CUDA_EMU_ACCESS(n)                      \
  void __asan_load##n##_noabort(uintptr_t a) {  \
    cuda_emu::count(a, n, false);               \
  }                                             \
  void __asan_store##n##_noabort(uintptr_t a) { \
    cuda_emu::count(a, n, true);                \
  }
CUDA_EMU_ACCESS(1)
CUDA_EMU_ACCESS(2)
CUDA_EMU_ACCESS(4)
CUDA_EMU_ACCESS(8)
CUDA_EMU_ACCESS(16)
#undef CUDA_EMU_ACCESS
void __asan_loadN_noabort(uintptr_t a, size_t n) {
  cuda_emu::count(a, n, false);
}
void __asan_storeN_noabort(uintptr_t a, size_t n) {
  cuda_emu::count(a, n, true);
}
void __asan_handle_no_return() {}
void __asan_before_dynamic_init(const char*) {}
void __asan_after_dynamic_init() {}
}
#endif
