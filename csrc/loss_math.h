// The per-token GRPO loss math of spec sections 3-5 and 7, written once for the CPU and CUDA kernels.
// Every derivative reproduces torch autograd's conventions exactly: torch.minimum splits the gradient half/half at a
// tie (ties are the common case: rho inside the clip range makes both branches equal), torch.clamp passes the
// gradient at its bounds.
#pragma once

#include "common.h"

namespace grpo_ext {

// Slots of the per-row partial sums that the kernels reduce into the loss and metrics.
enum RowSlot : int { kSlotLoss = 0, kSlotMask, kSlotKL, kSlotLow, kSlotHigh, kSlotRegion, kSlotCispo, kNumRowSlots };
// Order of the metrics vector returned by the forward op.
enum MetricSlot : int { kMetricKL = 0, kMetricLow, kMetricHigh, kMetricRegion, kMetricCispo, kNumMetrics };

struct LossParams {
  LossType loss_type = LossType::kGRPO;
  KLEstimator kl_estimator = KLEstimator::kK3;
  double epsilon_low = 0.2;
  double epsilon_high = 0.2;  // for cispo: the absolute cap on rho
  bool has_delta = false;
  double delta = 0.0;
  double beta = 0.0;
  bool has_kl_clamp = false;
  double kl_clamp = 0.0;
  bool bias_correction = false;
  bool sequence_level = false;
  bool row_share_metrics = false;  // sequence level with one advantage per row: clip shares are shares of rows
  bool has_old = false;
  double sapo_tau_pos = 1.0;
  double sapo_tau_neg = 1.05;
  bool compute_grad = true;
};

// The loss op's inputs as strided views; absent optional inputs have data == nullptr.
struct LossInputs {
  StridedMatrix logps, old_logps, ref_logps, advantages, is_weights, mask, sample_mask;
  int64_t batch = 0;
  int64_t seq_len = 0;

  // m_eff = completion_mask * sample_mask (spec section 3).
  template <typename T>
  GRPO_HD T mask_at(int64_t row, int64_t col) const {
    T m = mask.load<T>(row, col);
    if (sample_mask.present()) m *= sample_mask.load<T>(row, 0);
    return m;
  }
};

// Only 'grpo' and 'sapo' normalize each row by its own length.
GRPO_HD bool per_row_normalized(LossType t) { return t == LossType::kGRPO || t == LossType::kSAPO; }

template <typename T>
struct TokenTerms {
  T loss;         // P = L * is_weight + beta * KL
  T kl;           // KL term as logged (times rho when bias-corrected)
  T dloss_drho;   // dP/drho, holding l fixed
  T dloss_dl;     // dP/dl through every path except rho
  bool low, high, cispo_clipped;
};

// d/dx of torch.minimum(a, b) given da/dx and db/dx.
template <typename T>
GRPO_HD T minimum_grad(T a, T b, T da, T db) {
  if (a < b) return da;
  if (a > b) return db;
  return (da + db) * T(0.5);
}

// expm1 for the k3 estimator. glibc's expm1f costs several times expf, so host float code uses a short series
// where exp(r) - 1 would cancel and exp(r) - 1 elsewhere (relative error below 1e-6 either way); device code and
// double precision keep the library function.
template <typename T>
GRPO_HD T kl_expm1(T r) {
  using std::expm1;
  return expm1(r);
}
#if !defined(__CUDA_ARCH__)
template <>
inline float kl_expm1<float>(float r) {
  if (r > -0.125f && r < 0.125f) {
    // Horner form of r + r^2/2! + ... + r^7/7!; the truncation error is below 2e-11 relative here.
    return r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
  }
  return std::exp(r) - 1.f;
}
#endif

// Clip-metric conditions (spec section 7): they test the uncapped rho.
template <typename T>
GRPO_HD void clip_flags(const LossParams& p, T rho, T adv, bool* low, bool* high, bool* cispo_clipped) {
  *low = rho < T(1) - T(p.epsilon_low) && adv < T(0);
  *high = rho > T(1) + T(p.epsilon_high) && adv > T(0);
  *cispo_clipped = rho > T(p.epsilon_high) && adv > T(0);
}

template <typename T>
GRPO_HD TokenTerms<T> token_terms(const LossParams& p, T l, T l_ref, T adv, T is_weight, T rho) {
  using std::exp;
  TokenTerms<T> out;
  const T lo = T(1) - T(p.epsilon_low);
  const T hi = T(1) + T(p.epsilon_high);
  T policy = T(0), dpolicy_drho = T(0), dpolicy_dl = T(0);

  if (p.loss_type == LossType::kCISPO) {
    const T cap = T(p.epsilon_high);
    const T w = rho < cap ? rho : cap;  // stop-gradient weight
    policy = -w * adv * l;
    dpolicy_dl = -w * adv;
  } else if (p.loss_type == LossType::kSAPO) {
    const T tau = adv > T(0) ? T(p.sapo_tau_pos) : T(p.sapo_tau_neg);
    const T s = T(1) / (T(1) + exp(-tau * (rho - T(1))));
    policy = -(T(4) / tau) * s * adv;
    dpolicy_drho = -T(4) * s * (T(1) - s) * adv;
  } else {  // clip family
    T rho_c = rho, drho_c = T(1);
    if (p.has_delta) {
      const T delta = T(p.delta);
      rho_c = rho < delta ? rho : delta;
      drho_c = rho <= delta ? T(1) : T(0);
    }
    const T rho_clip = rho < lo ? lo : (rho > hi ? hi : rho);
    const T drho_clip = (rho >= lo && rho <= hi) ? T(1) : T(0);
    const T a = rho_c * adv, b = rho_clip * adv;
    policy = -(a < b ? a : b);
    dpolicy_drho = -minimum_grad(a, b, drho_c * adv, drho_clip * adv);
  }
  out.loss = policy * is_weight;
  out.dloss_drho = dpolicy_drho * is_weight;
  out.dloss_dl = dpolicy_dl * is_weight;

  out.kl = T(0);
  if (p.beta != 0.0) {
    T r = l_ref - l, pass = T(1);
    if (p.has_kl_clamp) {
      const T c = T(p.kl_clamp);
      pass = (r >= -c && r <= c) ? T(1) : T(0);
      r = r < -c ? -c : (r > c ? c : r);
    }
    T kl, dkl_dr;
    if (p.kl_estimator == KLEstimator::kK1) {
      kl = -r;
      dkl_dr = T(-1);
    } else if (p.kl_estimator == KLEstimator::kK2) {
      kl = T(0.5) * r * r;
      dkl_dr = r;
    } else {  // k3; expm1 keeps exp(r) - r - 1 accurate when r is small
      const T em1 = kl_expm1(r);
      kl = em1 - r;
      dkl_dr = em1;
    }
    const T dkl_dl = -dkl_dr * pass;
    const T beta = T(p.beta);
    if (p.bias_correction) {
      out.kl = rho * kl;
      out.dloss_drho += beta * kl;
      out.dloss_dl += beta * rho * dkl_dl;
    } else {
      out.kl = kl;
      out.dloss_dl += beta * dkl_dl;
    }
    out.loss += beta * out.kl;
  }

  clip_flags(p, rho, adv, &out.low, &out.high, &out.cispo_clipped);
  return out;
}

// The global factor applied to the sum of row partials (and, in backward, to the raw gradient).
template <typename T>
GRPO_HD T global_loss_scale(const LossParams& p, int64_t batch, int64_t max_completion_length, T mask_total,
                            bool has_num_items, T num_items, T loss_scale) {
  const T count = mask_total > T(1) ? mask_total : T(1);
  T denom;
  switch (p.loss_type) {
    case LossType::kBNPO: denom = count; break;
    case LossType::kDrGRPO: denom = T(batch) * T(max_completion_length); break;
    case LossType::kDAPO:
    case LossType::kCISPO: denom = has_num_items ? num_items : count; break;
    default: denom = T(batch); break;  // grpo, sapo, luspo
  }
  return loss_scale / denom;
}

// Batch totals of the row partials (summed by the caller in a fixed order) -> loss, metrics and the gradient scale.
template <typename T>
GRPO_HD void finalize_loss(const LossParams& p, const T* totals, int64_t batch, int64_t max_completion_length,
                           bool has_num_items, T num_items, T loss_scale, T* loss_out, T* metrics_out,
                           T* grad_scale_out) {
  const T mask_total = totals[kSlotMask];
  const T scale = global_loss_scale(p, batch, max_completion_length, mask_total, has_num_items, num_items, loss_scale);
  *loss_out = totals[kSlotLoss] * scale;
  *grad_scale_out = scale;
  const T token_count = mask_total > T(1) ? mask_total : T(1);
  const T share_denom = p.row_share_metrics ? T(batch) : token_count;
  metrics_out[kMetricKL] = totals[kSlotKL] / token_count;
  metrics_out[kMetricLow] = totals[kSlotLow] / share_denom;
  metrics_out[kMetricHigh] = totals[kSlotHigh] / share_denom;
  metrics_out[kMetricRegion] = totals[kSlotRegion] / share_denom;
  metrics_out[kMetricCispo] = totals[kSlotCispo] / share_denom;
}

}  // namespace grpo_ext
