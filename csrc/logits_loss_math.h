// The loss math that only the logits kernels add to grpo_loss_math.h (docs/math.md sections 2 and 5), written once
// for the CPU and CUDA kernels: each row's share of the gradient scale, the per-token d loss / d logp, the entropy
// bonus' weight and the mean entropy over the kept tokens.
#pragma once

#include "grpo_loss_math.h"

namespace grpo_ext {

// ---------------------------------------------------------------------------------------------------------------
// The logits kernels: for the token-level losses, d loss / d logp of token (b, t) is
//   row_weight[b] * m[b, t] * (dP/dl + dP/drho * rho),  row_weight[b] = global scale * (1 / max(n_b, 1) or 1),
// and every factor but the token's own log-prob is known from the masks before any logits row is read. That is
// what lets one pass over a row compute the log-prob and write the gradient.
// ---------------------------------------------------------------------------------------------------------------

// Row b's share of the gradient scale, given n_b and the global scale.
template <typename T>
GRPO_HD T logits_row_weight(LossType t, T count, T global_scale) {
  return per_row_normalized(t) ? global_scale / (count > T(1) ? count : T(1)) : global_scale;
}

// The entropy bonus' weight of a kept token's entropy gradient, before its mask value (docs/math.md section 5,
// "Entropy bonus"): entropy_coef * loss_scale / max(sum m, 1).
template <typename T>
GRPO_HD T entropy_row_weight(T entropy_coef, T loss_scale, T mask_total) {
  return entropy_coef * loss_scale / (mask_total > T(1) ? mask_total : T(1));
}

// The factor of the bonus' mean taken off the loss: entropy_coef * loss_scale (0 without a bonus).
template <typename T>
GRPO_HD T entropy_bonus_scale(T entropy_coef, T loss_scale) {
  return entropy_coef == T(0) ? T(0) : entropy_coef * loss_scale;
}

// The mean entropy over the kept tokens weighted by their mask values, sum m H / max(sum m, 1) (a mask of 0.5 halves
// a token's share, as in the loss and the gradient; H is 0 at every token not kept: the passes write it so), and the
// bonus' mean weighted by w, sum m w H / max(sum m w, 1) (the plain mean without weights): from the float64 sums
// {sum m H, sum m, sum m w H, sum m w} (docs/math.md section 5, "Entropy bonus").
struct EntropyMeans {
  double mean, weighted_mean;
};
GRPO_HD EntropyMeans entropy_means(const double (&sums)[4], bool weighted) {
  const double mean = sums[0] / (sums[1] > 1.0 ? sums[1] : 1.0);
  return {mean, weighted ? sums[2] / (sums[3] > 1.0 ? sums[3] : 1.0) : mean};
}

// m * w of token (b, t) in the bonus' mean: its kept mask value m times its entropy weight w (m when absent), and 0
// where the token is masked, whatever w holds there (docs/math.md: masked positions are inert, a NaN weight included).
template <typename T>
GRPO_HD T entropy_weight_at(T m, const StridedMatrix& w, int64_t b, int64_t t) {
  if (!w.present()) return m;
  return m != T(0) ? m * w.load<T>(b, t) : T(0);
}

// The four sums of entropy_means at token (b, t): m its kept mask, h its entropy, w its entropy weight (absent: none).
GRPO_HD void add_entropy_sums(double (&sums)[4], double m, double h, const StridedMatrix& w, int64_t b, int64_t t) {
  sums[0] += m * h;
  sums[1] += m;
  if (w.present()) {
    const double mw = entropy_weight_at(m, w, b, t);
    sums[2] += mw * h;
    sums[3] += mw;
  }
}

// dP/dl + dP/drho * rho for one token (the caller multiplies by its weight); rho = 1 when on-policy.
template <typename T>
GRPO_HD T token_logp_grad(const TokenConsts<T>& c, PolicyFamily family, KLKind kl, bool bias_correction, bool has_old,
                          T l, T l_old, T l_ref, T adv, T is_weight) {
  const T rho = math_exp(log_ratio_of(l, has_old ? l_old : l));  // 1 on-policy (NaN for a non-finite l)
  const TokenTerms<T> tt = token_terms<T>(c, family, kl, bias_correction, l, l_ref, adv, is_weight, rho);
  return token_level_grad(tt, rho);
}

}  // namespace grpo_ext
