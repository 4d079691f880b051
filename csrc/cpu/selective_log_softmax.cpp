// CPU kernels of selective_log_softmax (docs/math.md section 2): rows in parallel, each row read in two vectorized
// passes (max, then the exponential sums); the backward recomputes the softmax from the saved logsumexp.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "../grpo_loss_math.h"
#include "../plan/selective_log_softmax.h"
#include "logits_rows.h"

namespace grpo_ext {
namespace {

using cpu::row_values;

// z = f(row `row` of the logits) as T: the row itself where it is contiguous T and f is the identity, else converted
// and scaled in one loop into `buffer` (a contiguous row from the copy of `isa`, a strided one through row_values).
template <typename T, bool kCapped>
const T* scaled_row_of(const StridedMatrix& logits, int64_t row, int64_t vocab, const LogitTransform<T>& f,
                       cpu::CpuIsa isa, T* buffer) {
  const void* raw = static_cast<const char*>(logits.data) + row * logits.row_stride * dtype_bytes(logits.dtype);
  if (logits.col_stride == 1 || vocab == 1) {
    constexpr DType kSame = sizeof(T) == sizeof(double) ? DType::kFloat64 : DType::kFloat32;
    if (logits.dtype == kSame && f.is_identity()) return static_cast<const T*>(raw);
    const auto scale = [&](auto in) {
      using In = decltype(in);
      GRPO_CPU_ISA_CALL(isa, scaled_row<T, In, kCapped>(static_cast<const In*>(raw), vocab, f, buffer));
    };
    switch (logits.dtype) {
      case DType::kFloat32: scale(float{}); return buffer;
      case DType::kFloat64: scale(double{}); return buffer;
      case DType::kBFloat16: scale(BFloat16{}); return buffer;
      case DType::kFloat16: scale(Half{}); return buffer;
      default: break;
    }
  }
  const T* x = cpu::row_values(logits, row, vocab, buffer);
  for (int64_t v = 0; v < vocab; ++v) buffer[v] = f.template z_of<kCapped>(x[v]);
  return buffer;
}

// kCapped: the soft-cap's tanh is compiled into its own loops, so the default path is unchanged.
template <typename T, bool kCapped>
void forward_impl(SelectiveLogSoftmaxPlan& plan) {
  const int64_t vocab = plan.vocab;
  const LogitTransform<T> f = plan.logit.transform<T>();
  T* logps = plan.logps.mutable_data_ptr<T>();
  T* entropy = plan.return_entropy ? plan.entropy.mutable_data_ptr<T>() : nullptr;
  T* stats = plan.row_stats.mutable_data_ptr<T>();
  std::atomic<int64_t> bad_row{plan.rows};
  const cpu::CpuIsa isa = cpu::cpu_isa();
  const int64_t grain = std::max<int64_t>(1, 65536 / vocab);
  torch::stable::parallel_for(0, plan.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> buffer(vocab);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t id = plan.ids.load<int64_t>(row, 0);
      if (id < 0 || id >= vocab) {  // the first such row is named, whichever thread meets it first
        cpu::note_first_row(bad_row, row);
        continue;
      }
      const T* z = scaled_row_of<T, kCapped>(plan.logits, row, vocab, f, isa, buffer.data());
      const cpu::RowSoftmax s = cpu::row_softmax<T>(z, vocab, nullptr);
      logps[row] = T(double(z[id]) - s.lse);
      if (entropy) entropy[row] = T(s.lse - s.mean_z);
      // exactly the row's largest z; NaN for a NaN row, whose log(sum) is (the vector max skips a NaN), as on CUDA
      stats[row * kSoftmaxStats] = T(s.max + (s.log_sum - s.log_sum));
      stats[row * kSoftmaxStats + 1] = T(s.log_sum);
      stats[row * kSoftmaxStats + 2] = T(s.mean_shift);
    }
  });
  const int64_t bad = bad_row.load();
  GRPO_CHECK(bad == plan.rows, "ids[", bad, "]=", plan.ids.load<int64_t>(bad, 0), " is outside the vocabulary [0, ",
             vocab, ")");
}

SelectiveLogSoftmaxResult selective_log_softmax_forward_cpu(const Tensor& logits, const Tensor& ids, double temperature,
                                                            double logit_scale, double logit_softcap,
                                                            bool return_entropy) {
  SelectiveLogSoftmaxPlan plan =
      plan_selective_log_softmax(logits, ids, temperature, logit_scale, logit_softcap, return_entropy);
  const bool capped = plan.logit.logit_softcap > 0;
  if (plan.logps.scalar_type() == ScalarType::Double) {
    capped ? forward_impl<double, true>(plan) : forward_impl<double, false>(plan);
  } else {
    capped ? forward_impl<float, true>(plan) : forward_impl<float, false>(plan);
  }
  return {plan.logps, plan.entropy, plan.row_stats};
}

// d/dz of g_l * logp + g_H * H: g_l * (onehot(id) - p) - g_H * p * (z - E_p[z]); then times dz/dx.
template <typename T, typename Out, bool kCapped>
void backward_impl(const Tensor& grad_logps, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                   const Tensor& ids, const Tensor& row_stats, const LogitOptions& logit, Tensor& grad_logits) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const StridedMatrix x_view = matrix_view(logits, rows, vocab, "logits", false);
  const StridedMatrix id_view = matrix_view(ids, rows, 1, "ids", true);
  const StridedMatrix gl_view = matrix_view(grad_logps, rows, 1, "grad_logps", true);
  StridedMatrix gh_view;
  if (grad_entropy.has_value()) gh_view = matrix_view(*grad_entropy, rows, 1, "grad_entropy", true);
  const T* stats = row_stats.mutable_data_ptr<T>();
  Out* out = grad_logits.mutable_data_ptr<Out>();
  const LogitTransform<T> f = logit.transform<T>();
  const cpu::CpuIsa isa = cpu::cpu_isa();
  const int64_t grain = std::max<int64_t>(1, 65536 / vocab);
  torch::stable::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> buffer(vocab);
    for (int64_t row = begin; row < end; ++row) {
      const T gl = gl_view.load<T>(row, 0);
      const T gh = gh_view.present() ? gh_view.load<T>(row, 0) : T(0);
      Out* out_row = out + row * vocab;
      if (gl == T(0) && gh == T(0)) {  // no upstream gradient: exactly 0 whatever the row holds (not 0 * NaN)
        std::fill(out_row, out_row + vocab, Out(0));
        continue;
      }
      const T* row_stats = stats + row * kSoftmaxStats;
      const T z_max = row_stats[0], log_sum = row_stats[1], mean_shift = row_stats[2];
      if (x_view.col_stride == 1) {  // the row as it lies, converted in the loop
        const Out* raw = static_cast<const Out*>(x_view.data) + row * x_view.row_stride;
        GRPO_CPU_ISA_CALL(
            isa, selective_grad_row<T, Out, Out, kCapped>(raw, vocab, z_max, log_sum, mean_shift, gl, gh, f, out_row));
      } else {
        const T* x = row_values(x_view, row, vocab, buffer.data());
        GRPO_CPU_ISA_CALL(
            isa, selective_grad_row<T, T, Out, kCapped>(x, vocab, z_max, log_sum, mean_shift, gl, gh, f, out_row));
      }
      const int64_t id = id_view.load<int64_t>(row, 0);
      if (id >= 0 && id < vocab) {  // the chosen token's entry, computed whole so it is rounded once
        const T z = f.template z_of<kCapped>(x_view.load<T>(row, id));
        // p = 0 as above: a -inf chosen logit gets gl * dz/dx (d logp / dz = 1 - 0), not 0 * -inf from the entropy
        const T shifted = z - z_max, d = shifted - log_sum;
        const bool counts = !(d <= T(-100));
        const T p = counts ? math_exp_rows(d) : T(0);
        const T spread = counts ? p * (shifted - mean_shift) : T(0);
        out_row[id] = Out((gl * (T(1) - p) - gh * spread) * f.template slope_of<kCapped>(z));
      }
    }
  });
}

Tensor selective_log_softmax_backward_cpu(const Tensor& grad_logps, const std::optional<Tensor>& grad_entropy,
                                          const Tensor& logits, const Tensor& ids, const Tensor& row_stats,
                                          double temperature, double logit_scale, double logit_softcap) {
  const LogitOptions logit = check_selective_log_softmax_backward(grad_logps, grad_entropy, logits, ids, row_stats,
                                                                  temperature, logit_scale, logit_softcap);
  Tensor grad_logits = new_empty(logits, logits.sizes(), logits.scalar_type());
  const auto run = [&](auto tag) {
    using Types = decltype(tag);
    using T = typename Types::first_type;
    using Out = typename Types::second_type;
    if (logit.logit_softcap > 0) {
      backward_impl<T, Out, true>(grad_logps, grad_entropy, logits, ids, row_stats, logit, grad_logits);
    } else {
      backward_impl<T, Out, false>(grad_logps, grad_entropy, logits, ids, row_stats, logit, grad_logits);
    }
  };
  if (logits.scalar_type() == ScalarType::Double) {
    run(std::pair<double, double>{});
  } else if (logits.scalar_type() == ScalarType::Float) {
    run(std::pair<float, float>{});
  } else if (logits.scalar_type() == ScalarType::BFloat16) {
    run(std::pair<float, BFloat16>{});
  } else {
    run(std::pair<float, Half>{});
  }
  return grad_logits;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("selective_log_softmax_forward", TORCH_BOX(&selective_log_softmax_forward_cpu));
  m.impl("selective_log_softmax_backward", TORCH_BOX(&selective_log_softmax_backward_cpu));
}

}  // namespace grpo_ext
