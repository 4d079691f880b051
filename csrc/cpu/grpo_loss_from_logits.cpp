// CPU kernel of the fused GRPO loss from logits (grpo_loss_from_logits_pass, grpo_loss_from_logits_pass_): rows in
// parallel, each row converted once into a float buffer, its softmax statistics taken, and its gradient written from
// that buffer (over the logits themselves in the in-place op). Masked rows are never read.

#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../logits_loss_math.h"
#include "../plan/logits_loss.h"
#include "logits_rows.h"

namespace grpo_ext {
namespace {

// The gradient's weights from the masks alone: per row, d loss / d logp's normalizer (docs/math.md section 5's
// denominators; only without token_grad), and the entropy bonus' entropy_coef * loss_scale / max(sum m * w, 1), w the
// entropy_weights (1 when absent).
template <typename T>
struct PassWeights {
  std::vector<T> rows;
  T entropy = T(0);
};

template <typename T>
PassWeights<T> pass_weights(const LogitsPassPlan& plan, bool policy_rows) {
  const LossInputs& in = plan.loss.inputs;
  std::vector<double> counts(in.batch);
  const StridedMatrix& w = plan.entropy_weights;
  double total = 0.0, non_empty = 0.0, entropy_total = 0.0;
  for (int64_t b = 0; b < in.batch; ++b) {
    double c = 0.0;
    for (int64_t t = 0; t < in.seq_len; ++t) {
      const double m = in.mask_at<double>(b, t);
      c += m;
      entropy_total += entropy_weight_at(m, w, b, t);
    }
    counts[b] = c;
    total += c;
    non_empty += c > 0.0 ? 1.0 : 0.0;
  }
  PassWeights<T> weights;
  weights.rows.assign(in.batch, T(0));
  weights.entropy = T(entropy_row_weight<double>(plan.entropy_coef, plan.loss.loss_scale, entropy_total));
  if (!policy_rows) return weights;
  const double scale =
      global_loss_scale<double>(plan.loss.params, in.batch, plan.loss.max_completion_length, total, non_empty,
                                plan.loss.has_num_items, plan.loss.num_items, plan.loss.loss_scale);
  for (int64_t b = 0; b < in.batch; ++b) {
    weights.rows[b] = T(logits_row_weight<double>(plan.loss.params.loss_type, counts[b], scale));
  }
  return weights;
}

// kCapped: the soft-cap's tanh is compiled into its own loops, so the default path is unchanged.
template <typename T, typename In, bool kCapped>
void logits_pass_impl(LogitsPassPlan& plan) {
  const LossParams& p = plan.loss.params;
  const LossInputs& in = plan.loss.inputs;
  const LogitsRows& logits = plan.logits;
  const int64_t vocab = logits.vocab;
  const bool want_grad = plan.compute_grad && plan.grad_data != nullptr;
  const bool grad_in_logits = want_grad && plan.grad_data == logits.data;
  // A kept row's id outside the vocabulary is an error naming the first such row. Where the gradient goes over the
  // logits they are checked before any write (a bad id must not leave half-written logits); elsewhere the row loop
  // notes them (the outputs are new and dropped with the error). Masked rows are never read, so their ids (padding
  // such as -100) are not checked, as on CUDA.
  const auto check_id = [&](int64_t r, int64_t id) {
    GRPO_CHECK(id >= 0 && id < vocab, "ids[", r, "]=", id, " is outside the vocabulary [0, ", vocab, ")");
  };
  if (grad_in_logits) {
    for (int64_t r = 0; r < logits.rows; ++r) {
      const int64_t n = plan.row_offset + r;
      if (in.mask_at<T>(n / in.seq_len, n % in.seq_len) != T(0)) check_id(r, plan.ids.load<int64_t>(r, 0));
    }
  }
  std::atomic<int64_t> first_bad_row{logits.rows};
  const bool policy_rows = want_grad && !plan.token_grad.present();
  const PassWeights<T> weights = policy_rows || (want_grad && plan.entropy_coef != 0.0)
                                     ? pass_weights<T>(plan, policy_rows)
                                     : PassWeights<T>{std::vector<T>(in.batch, T(0)), T(0)};
  const TokenConsts<T> consts(p);
  const PolicyFamily family = policy_family(p.loss_type);
  const KLKind kl = kl_kind(p);
  const bool want_kl = p.beta != 0.0;
  const LogitTransform<T> f = plan.logit.transform<T>();
  T* logps = plan.logps.mutable_data_ptr<T>();
  T* entropy = plan.entropy.mutable_data_ptr<T>();
  In* grad = static_cast<In*>(plan.grad_data);
  // z = x (no scale, no cap, the accumulate type): the row is read where it lies, not copied (except when the
  // gradient is written over it, since the bonus reads z[id] after the row loop)
  const bool z_is_row = std::is_same_v<In, T> && f.is_identity() && !grad_in_logits;
  const cpu::CpuIsa isa = cpu::cpu_isa();
  const int64_t grain = std::max<int64_t>(1, 65536 / vocab);
  torch::stable::parallel_for(0, logits.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> z_buffer(z_is_row ? 0 : vocab), exps(want_grad ? vocab : 0);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = plan.row_offset + r, b = n / in.seq_len, t = n % in.seq_len;
      const T m = in.mask_at<T>(b, t);
      In* grad_row = want_grad ? (grad_in_logits ? grad + logits.offset(r) : grad + r * vocab) : nullptr;
      if (m == T(0)) {  // never read; a zero gradient
        logps[r] = T(0);
        entropy[r] = T(0);
        if (grad_row) std::fill(grad_row, grad_row + vocab, In(0));
        continue;
      }
      const int64_t id = plan.ids.load<int64_t>(r, 0);
      if (id < 0 || id >= vocab) {  // (only where not checked above) no row of it is read or written
        cpu::note_first_row(first_bad_row, r);
        continue;
      }
      const In* x = static_cast<const In*>(logits.data) + logits.offset(r);
      const T* z = z_is_row ? reinterpret_cast<const T*>(x) : z_buffer.data();
      if (!z_is_row) GRPO_CPU_ISA_CALL(isa, scaled_row<T, In, kCapped>(x, vocab, f, z_buffer.data()));
      const cpu::RowSoftmax s = cpu::row_softmax(z, vocab, want_grad ? exps.data() : nullptr);
      const T logp = T(double(z[id]) - s.lse);
      logps[r] = logp;
      entropy[r] = T(s.lse - s.mean_z);
      if (!grad_row) continue;
      T g;
      if (plan.token_grad.present()) {
        g = plan.token_grad.load<T>(r, 0);
      } else {
        const T l_old = p.has_old ? in.old_logps.load<T>(b, t) : logp;
        const T l_ref = want_kl ? in.ref_logps.load<T>(b, t) : T(0);
        const T isw = (in.is_weights.present() ? in.is_weights.load<T>(b, t) : T(1)) *
                      (in.policy_weights.present() ? in.policy_weights.load<T>(b, t) : T(1));
        g = weights.rows[b] * m *
            token_logp_grad<T>(consts, family, kl, p.bias_correction, p.has_old, logp, l_old, l_ref,
                               in.advantages.load<T>(b, t), isw);
      }
      // d/dz_v of g * logp = g * (onehot - p_v), times dz/dx; the chosen entry as -expm1(logp), exact where p -> 1.
      // The entropy bonus adds e * p_v * (z_v - E_p[z]) (an entry with p_v = 0 adds exactly 0, even at z = -inf).
      const T e = weights.entropy * entropy_weight_at(m, plan.entropy_weights, b, t);
      const T inv_sum = T(1.0 / s.sum), z_max = T(s.max), mean_shift = T(s.mean_shift);
      const T* p_exps = exps.data();
      if (e == T(0)) {
        // uncapped, dz/dx is the constant f.slope, folded into the scale
        const T scale = kCapped ? T(-double(g) / s.sum) : T(-double(g) / s.sum) * f.slope;
        GRPO_CPU_ISA_CALL(isa, policy_grad_row<T, In, kCapped>(p_exps, z, vocab, scale, f, grad_row));
        grad_row[id] = In(g * -math_expm1(logp) * f.template slope_of<kCapped>(z[id]));
      } else {
        const T scale = T(-double(g) / s.sum);
        const T bonus_id = exps[id] == T(0) ? T(0) : exps[id] * inv_sum * ((z[id] - z_max) - mean_shift);
        GRPO_CPU_ISA_CALL(isa, policy_bonus_grad_row<T, In, kCapped>(p_exps, z, vocab, scale, e, inv_sum, z_max,
                                                                     mean_shift, f, grad_row));
        grad_row[id] = In((g * -math_expm1(logp) + e * bonus_id) * f.template slope_of<kCapped>(z[id]));
      }
    }
  });
  const int64_t bad = first_bad_row.load();
  if (bad < logits.rows) check_id(bad, plan.ids.load<int64_t>(bad, 0));
}

template <bool kCapped>
void run_logits_pass_impl(LogitsPassPlan& plan) {
  switch (plan.logits.dtype) {
    case DType::kFloat64: logits_pass_impl<double, double, kCapped>(plan); break;
    case DType::kFloat32: logits_pass_impl<float, float, kCapped>(plan); break;
    case DType::kBFloat16: logits_pass_impl<float, BFloat16, kCapped>(plan); break;
    case DType::kFloat16: logits_pass_impl<float, Half, kCapped>(plan); break;
    default: GRPO_CHECK(false, "logits must be float32, float64, bfloat16 or float16");
  }
}

LogitsPassResult run_logits_pass(LogitsPassPlan& plan) {
  if (plan.logit.logit_softcap > 0) {
    run_logits_pass_impl<true>(plan);
  } else {
    run_logits_pass_impl<false>(plan);
  }
  return plan.result();
}

LogitsPassResult grpo_loss_from_logits_pass_cpu(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/false);
  return run_logits_pass(plan);
}

std::tuple<Tensor, Tensor> grpo_loss_from_logits_pass_inplace_cpu(GRPO_LOSS_FROM_LOGITS_PASS_PARAMS) {
  check_inplace_logits(logits);
  LogitsPassPlan plan = plan_grpo_loss_from_logits(GRPO_LOSS_FROM_LOGITS_PASS_ARGS, /*inplace=*/true);
  run_logits_pass(plan);
  return {plan.logps, plan.entropy};
}

// The mean entropy over the kept tokens from float64 sums in token order (entropy_means), and the bonus taken off
// the loss.
template <typename T>
void entropy_mean_impl(const LossInputs& in, const StridedMatrix& weights, const T* entropy, double bonus_scale,
                       T* loss, T* mean) {
  double sums[4] = {};
  for (int64_t b = 0; b < in.batch; ++b) {
    for (int64_t t = 0; t < in.seq_len; ++t) {
      add_entropy_sums(sums, in.mask_at<double>(b, t), double(entropy[b * in.seq_len + t]), weights, b, t);
    }
  }
  const EntropyMeans means = entropy_means(sums, weights.present());
  *mean = T(means.mean);
  if (bonus_scale != 0.0) *loss = T(double(*loss) - bonus_scale * means.weighted_mean);
}

// The CPU kernels of logits_loss (plan/logits_loss.h).
struct CpuLogitsLoss {
  void pass(LogitsPassPlan& plan, bool /*grad_in_logits: the plan points at the logits already*/) {
    run_logits_pass(plan);
  }
  void loss(LossForwardPlan& plan) { run_loss_forward_cpu(plan); }
  Tensor entropy(const LogitsPassPlan& plan, double entropy_coef, Tensor& loss) {
    const double bonus_scale = entropy_bonus_scale(entropy_coef, plan.loss.loss_scale);  // a host loss_scale here
    const Tensor& entropy = plan.entropy;
    Tensor mean = new_empty(entropy, {}, entropy.scalar_type());
    if (entropy.scalar_type() == ScalarType::Double) {
      entropy_mean_impl<double>(plan.loss.inputs, plan.entropy_weights, entropy.const_data_ptr<double>(), bonus_scale,
                                loss.mutable_data_ptr<double>(), mean.mutable_data_ptr<double>());
    } else {
      entropy_mean_impl<float>(plan.loss.inputs, plan.entropy_weights, entropy.const_data_ptr<float>(), bonus_scale,
                               loss.mutable_data_ptr<float>(), mean.mutable_data_ptr<float>());
    }
    return mean;
  }
};

LogitsLossResult grpo_loss_from_logits_cpu(GRPO_LOGITS_LOSS_PARAMS) {
  CpuLogitsLoss device;
  return logits_loss(device, GRPO_LOGITS_LOSS_ARGS, /*inplace=*/false);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> grpo_loss_from_logits_inplace_cpu(GRPO_LOGITS_LOSS_PARAMS) {
  check_inplace_logits(logits);
  CpuLogitsLoss device;
  auto [loss, metrics, mean, grad, logps, entropy] = logits_loss(device, GRPO_LOGITS_LOSS_ARGS, /*inplace=*/true);
  return {loss, metrics, mean, logps, entropy};
}

// grad *= factor unless factor is exactly 1 (reading a CPU scalar costs no device sync).
void scale_grad_cpu(Tensor& grad, const Tensor& factor) {
  GRPO_CHECK(factor.numel() == 1, "factor must have one element, got shape ", shape(factor));
  GRPO_CHECK(factor.is_cpu(), "factor must be a CPU tensor for the CPU kernel");
  const double value = StridedMatrix{factor.data_ptr(), dtype_tag(factor.scalar_type(), "factor")}.load<double>(0, 0);
  if (value != 1.0) mul_(grad, torch::stable::to(torch::stable::reshape(factor, {}), grad.scalar_type()));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(grpo_ext, CPU, m) {
  m.impl("grpo_loss_from_logits_pass", TORCH_BOX(&grpo_loss_from_logits_pass_cpu));
  m.impl("grpo_loss_from_logits_pass_", TORCH_BOX(&grpo_loss_from_logits_pass_inplace_cpu));
  m.impl("scale_grad_", TORCH_BOX(&scale_grad_cpu));
  m.impl("grpo_loss_from_logits", TORCH_BOX(&grpo_loss_from_logits_cpu));
  m.impl("grpo_loss_from_logits_", TORCH_BOX(&grpo_loss_from_logits_inplace_cpu));
}

}  // namespace grpo_ext
