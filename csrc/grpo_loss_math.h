// The per-token GRPO loss math of docs/math.md sections 3-5 and 7, written once for the CPU and CUDA kernels.
// Every derivative follows docs/math.md section 8, "Bounds and ties": a minimum splits the gradient half/half at a
// tie (ties are the common case: rho inside the clip range makes both branches equal), a clamp passes the gradient
// at its bounds. Over 300 lines because the per-token terms, their dispatch and the aggregation are one
// contract that the CPU and CUDA kernels must share; splitting it would spread the math over several headers. The
// parameters, inputs and slots it works on are grpo_loss_params.h (which the host plan needs alone). What only the
// logits kernels add on top (row weights, the entropy bonus and its mean) is in logits_loss_math.h.
#pragma once

#include "common.h"
#include "fast_math.h"
#include "grpo_loss_params.h"

namespace grpo_ext {

// verl's low_var_kl (and k3+) clamps the k3 estimate to [-10, 10]; k3 >= 0, so only the upper bound acts.
constexpr double kLowVarKLCap = 10.0;

// The hyperparameters in the compute type, converted once per kernel rather than per token.
// An unset delta or KL clamp is an infinite bound, which leaves every finite value (and its gradient) alone: the
// token code needs no branch for them.
// VESPO (docs/math.md section 3), as TRL 1.16's get_gamma_weights: the bounds of a token's log-ratio, of the row's
// log-weight (log 1e-8 below) and the smallest lambda.
constexpr double kVespoLogRatioBound = 20.0;
constexpr double kVespoMinLogWeight = -18.420680743952367;  // log(1e-8)
constexpr double kVespoMinLambda = 1e-4;

template <typename T>
struct TokenConsts {
  T clip_low, clip_high, cispo_cap, delta, beta, kl_clamp, tau_pos, tau_neg;
  T vespo_k_pos, vespo_k_neg, vespo_lambda_pos, vespo_lambda_neg;
  GRPO_HD explicit TokenConsts(const LossParams& p)
      // 1 -+ epsilon rounded once to T (in float32, 1 - T(0.058) would be one step above the bound, 0.94200003)
      : clip_low(T(1.0 - p.epsilon_low)),
        clip_high(T(1.0 + p.epsilon_high)),
        cispo_cap(T(p.epsilon_high)),
        delta(p.has_delta ? T(p.delta) : T(INFINITY)),
        beta(T(p.beta)),
        kl_clamp(p.has_kl_clamp ? T(p.kl_clamp) : T(INFINITY)),
        tau_pos(T(p.sapo_tau_pos)),
        tau_neg(T(p.sapo_tau_neg)),
        vespo_k_pos(T(p.vespo_k_pos)),
        vespo_k_neg(T(p.vespo_k_neg)),
        vespo_lambda_pos(T(p.vespo_lambda_pos > kVespoMinLambda ? p.vespo_lambda_pos : kVespoMinLambda)),
        vespo_lambda_neg(T(p.vespo_lambda_neg > kVespoMinLambda ? p.vespo_lambda_neg : kVespoMinLambda)) {}
};

template <typename T>
struct TokenTerms {
  T loss;        // P = L * is_weight + beta * KL
  T kl;          // KL term as logged (times rho when bias-corrected)
  T dloss_drho;  // dP/drho, holding l fixed
  // dP/dl is token_dl + rho * (a factor). Where rho is the token's own exp(l - l_old), the factor is token_drho
  // (token_level_grad): with bias correction the KL's own path, rho * dKL/dl, joins dP/drho as beta * (KL + dKL/dl)
  // taken as one (KLTerms::kl_and_slope). Where rho is the row's (sequence level), the factor is the row's summed
  // dP/drho times m / n plus, with bias correction, beta * dKL/dl (kl_slope). Either way an overflowed rho gives the
  // limit, not inf - inf (docs/math.md section 8).
  T token_dl;                  // dP/dl through every path without rho
  T token_drho;                // the token level's factor of rho
  T low, high, cispo_clipped;  // clip-metric conditions (docs/math.md section 7) as 0/1; they test the uncapped rho
};

// d/dx of torch.minimum(a, b) given da/dx and db/dx.
template <typename T>
GRPO_HD T minimum_grad(T a, T b, T da, T db) {
  return a < b ? da : (a > b ? db : (da + db) * T(0.5));
}

// Clip-metric conditions (docs/math.md section 7) as 0/1; they test the uncapped rho.
template <typename T>
GRPO_HD void clip_flags(const TokenConsts<T>& c, T rho, T adv, T* low, T* high, T* cispo_clipped) {
  *low = ((rho < c.clip_low) & (adv < T(0))) ? T(1) : T(0);
  *high = ((rho > c.clip_high) & (adv > T(0))) ? T(1) : T(0);
  *cispo_clipped = ((rho > c.cispo_cap) & (adv > T(0))) ? T(1) : T(0);
}

// The clip shares of a row whose tokens share one ratio (row_share_metrics: one condition per row, every row
// counted), written over its partial sums `slots` (kNumRowSlots + 1 of them, double on both devices).
template <typename T>
GRPO_HD void set_row_clip_shares(const TokenConsts<T>& c, T row_ratio, T adv, double* slots) {
  T low, high, cispo;
  clip_flags<T>(c, row_ratio, adv, &low, &high, &cispo);
  slots[kSlotLow] = low;
  slots[kSlotHigh] = high;
  slots[kSlotRegion] = low + high;
  slots[kSlotCispo] = cispo;
}

// l - l_old, made NaN when either is not finite (docs/math.md "Non-finite inputs"): l = -inf against a finite l_old
// would otherwise give rho = 0 and a finite loss. x - x is 0 for a finite x and NaN otherwise (no fast-math here).
template <typename T>
GRPO_HD T log_ratio_of(T l, T l_old) {
  return (l - l_old) + ((l - l) + (l_old - l_old));
}

// dP/drho * rho, the gradient through rho = exp(d), with an exactly-zero dP/drho giving 0 even where rho overflowed to
// +inf (docs/math.md section 8, "An overflowing ratio"): dP/drho is 0 for every large finite rho there (a clipped
// token, A = 0, a capped or saturated ratio), so the limit is 0, not 0 * inf = NaN. A NaN on either side stays NaN
// (a NaN rho is a non-finite input, which must reach the gradient even where the loss stops it, as cispo does).
template <typename T>
GRPO_HD T through_ratio_exp(T dloss_drho, T rho) {
  return ((dloss_drho == T(0)) & (rho == rho)) ? T(0) : dloss_drho * rho;
}

// x clamped to [lo, hi]; NaN stays NaN (as torch.clamp).
template <typename T>
GRPO_HD T clamp_keep_nan(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// VESPO: token t's term of its row's log-weight, clamp(d, -20, 20) + clamp(log is_weight, log 1e-8, 20) (the caller
// multiplies by m and sums the row). A non-finite is_weight gives NaN (TRL would clamp +inf to 20), a zero one log
// 1e-8.
template <typename T>
GRPO_HD T vespo_token_log_weight(T d, T is_weight, bool has_is_weights) {
  T term = clamp_keep_nan(d, T(-kVespoLogRatioBound), T(kVespoLogRatioBound));
  if (has_is_weights) {
    using std::log;
    term += clamp_keep_nan(log(is_weight) + (is_weight - is_weight), T(kVespoMinLogWeight), T(kVespoLogRatioBound));
  }
  return term;
}

// VESPO: the row's log-weight log w from the sum of its tokens' terms.
template <typename T>
GRPO_HD T vespo_row_log_weight(T sum) {
  return clamp_keep_nan(sum, T(kVespoMinLogWeight), T(kVespoLogRatioBound));
}

// VESPO's gamma weight phi = exp(lambda + k * log w - lambda * w), (k, lambda) by the sign of A (A >= 0: the
// positive pair). An overflowing phi is 0, as TRL's nan_to_num(posinf=0) makes it; a NaN log w stays NaN.
template <typename T>
GRPO_HD T vespo_phi(const TokenConsts<T>& c, T log_w, T adv) {
  const bool nonneg = adv >= T(0);
  const T k = nonneg ? c.vespo_k_pos : c.vespo_k_neg;
  const T lambda = nonneg ? c.vespo_lambda_pos : c.vespo_lambda_neg;
  const T log_phi = lambda + k * log_w - lambda * math_exp(log_w);
  const T max_log = sizeof(T) == sizeof(double) ? T(709.782712893384) : T(88.72283905812);  // log of the largest T
  return log_phi > max_log ? T(0) : math_exp(log_phi);
}

// One token's KL estimate (docs/math.md section 4) at r = l_ref - l, clamped to kl_clamp where set.
template <typename T>
struct KLTerms {
  T kl;            // the estimate
  T dkl_dl;        // dKL/dl, 0 where a clamp cut it
  T kl_and_slope;  // KL + dKL/dl: for k3 and low_var_kl, l - l_ref where the gradient passes (the bias-corrected
                   // KL's factor of rho; as a sum, exp(r) - r - 1 and 1 - exp(r) cancel to noise past r ~ 15 in
                   // float32)
};

template <typename T, KLKind kKL>
GRPO_HD KLTerms<T> kl_terms_t(const TokenConsts<T>& c, T l, T l_ref) {
  const T r_raw = l_ref - l;
  T r = r_raw;
  const bool inside = (r >= -c.kl_clamp) & (r <= c.kl_clamp);  // a clamp passes the gradient at its bounds
  r = r < -c.kl_clamp ? -c.kl_clamp : (r > c.kl_clamp ? c.kl_clamp : r);
  T kl, dkl_dr;
  bool passes = inside;  // whether the gradient reaches l through the clamps
  if constexpr (kKL == KLKind::kK1) {
    kl = -r;
    dkl_dr = T(-1);
  } else if constexpr (kKL == KLKind::kK2) {
    kl = T(0.5) * r * r;
    dkl_dr = r;
  } else if constexpr (kKL == KLKind::kAbs) {  // |r|, gradient sign(r) (0 at r = 0 as torch.abs; NaN stays NaN)
    kl = r < T(0) ? -r : r;
    dkl_dr = r > T(0) ? T(1) : (r < T(0) ? T(-1) : (r == T(0) ? T(0) : r));
  } else if constexpr (kKL == KLKind::kK1Plus) {  // straight-through: k1's value, k2's gradient on the unclamped r
    kl = -r;
    dkl_dr = r_raw;
    passes = true;
  } else {  // k3: exp(r) - r - 1, through expm1 so that small r keeps its precision
    const T em1 = math_expm1(r);
    kl = em1 - r;
    dkl_dr = em1;
    if constexpr (kKL == KLKind::kK3Plus || kKL == KLKind::kLowVarKL) {  // verl clamps the estimate at 10
      const bool above = kl > T(kLowVarKLCap);                           // NaN is not above: it stays visible
      kl = above ? T(kLowVarKLCap) : kl;
      if constexpr (kKL == KLKind::kK3Plus) {  // straight-through: k2's gradient on the unclamped r
        dkl_dr = r_raw;
        passes = true;
      } else {
        passes = passes & !above;
      }
    }
  }
  KLTerms<T> out;
  out.kl = kl;
  out.dkl_dl = passes ? -dkl_dr : T(0);
  if constexpr (kKL == KLKind::kK3 || kKL == KLKind::kLowVarKL) {
    out.kl_and_slope = passes ? -r : kl;
  } else {
    out.kl_and_slope = kl + out.dkl_dl;
  }
  return out;
}

// beta * dKL/dl for an estimator chosen at run time (0 for kNone): at the sequence level, the bias-corrected KL's
// own path is rho_i times it, and the kernels add it to the row's ratio path as one factor of rho_i (docs/math.md
// section 8) in a loop of their own, after the row is summed.
template <typename T>
GRPO_HD T kl_slope(const TokenConsts<T>& c, KLKind kind, T l, T l_ref) {
  T dkl_dl = T(0);
  switch (kind) {
    case KLKind::kNone: break;
    case KLKind::kK1: dkl_dl = kl_terms_t<T, KLKind::kK1>(c, l, l_ref).dkl_dl; break;
    case KLKind::kK2: dkl_dl = kl_terms_t<T, KLKind::kK2>(c, l, l_ref).dkl_dl; break;
    case KLKind::kK3: dkl_dl = kl_terms_t<T, KLKind::kK3>(c, l, l_ref).dkl_dl; break;
    case KLKind::kAbs: dkl_dl = kl_terms_t<T, KLKind::kAbs>(c, l, l_ref).dkl_dl; break;
    case KLKind::kK1Plus: dkl_dl = kl_terms_t<T, KLKind::kK1Plus>(c, l, l_ref).dkl_dl; break;
    case KLKind::kK3Plus: dkl_dl = kl_terms_t<T, KLKind::kK3Plus>(c, l, l_ref).dkl_dl; break;
    case KLKind::kLowVarKL: dkl_dl = kl_terms_t<T, KLKind::kLowVarKL>(c, l, l_ref).dkl_dl; break;
  }
  return c.beta * dkl_dl;
}

// Per-token loss, KL, their derivatives and the clip conditions for one policy family and KL estimator; only
// selects depend on the data, so the CPU compiler vectorizes a loop over this. A token with a non-finite input (rho
// is NaN when l or l_old is not finite, see log_ratio_of) gets NaN terms: loss, KL and both derivatives.
// For vespo, `is_weight` is the token's phi (vespo_phi; the is_weights entered its row's log-weight instead).
template <typename T, PolicyFamily kFamily, KLKind kKL, bool kBias>
GRPO_HD TokenTerms<T> token_terms_t(const TokenConsts<T>& c, T l, T l_ref, T adv, T is_weight, T rho) {
  TokenTerms<T> out;
  T poison = (l - l) + (adv - adv) + (is_weight - is_weight) + (rho == rho ? T(0) : rho);  // 0 or NaN
  T policy, dpolicy_drho = T(0), dpolicy_dl = T(0);
  bool linear = false;  // the policy term is rho * (-A): the clip family's unclipped, uncapped branch
  if constexpr (kFamily == PolicyFamily::kCispo) {
    const T w = rho < c.cispo_cap ? rho : c.cispo_cap;  // a stop-gradient weight
    policy = -w * adv * l;
    dpolicy_dl = -w * adv;
  } else if constexpr (kFamily == PolicyFamily::kVespo) {  // -sg(phi) * A * l, phi passed as is_weight
    policy = -adv * l;
    dpolicy_dl = -adv;
  } else if constexpr (kFamily == PolicyFamily::kSapo) {
    const T tau = adv > T(0) ? c.tau_pos : c.tau_neg;
    const T s = T(1) / (T(1) + math_exp(-tau * (rho - T(1))));
    policy = -(T(4) / tau) * s * adv;
    dpolicy_drho = -T(4) * s * (T(1) - s) * adv;
  } else {  // clip family: -min(rho_c * A, clamp(rho, lo, hi) * A), rho_c = min(rho, delta) when delta is set
    const bool capped = rho > c.delta;
    const T rho_c = capped ? c.delta : rho;
    const T drho_c = capped ? T(0) : T(1);
    const T rho_clip = rho < c.clip_low ? c.clip_low : (rho > c.clip_high ? c.clip_high : rho);
    const T drho_clip = ((rho >= c.clip_low) & (rho <= c.clip_high)) ? T(1) : T(0);
    const T a = rho_c * adv, b = rho_clip * adv;
    policy = -(a < b ? a : b);
    dpolicy_drho = -minimum_grad(a, b, drho_c * adv, drho_clip * adv);
    linear = (a < b) & !capped;
  }
  // The loss is the terms without rho plus rho times a factor: the linear policy term's -A * is_weight and the
  // bias-corrected KL's beta * KL, summed before rho multiplies them, so that an overflowed rho gives the limit by
  // the factor's sign (0 where it is exactly 0), not inf - inf (k1's KL < 0 beside A < 0) or inf * 0 (a zero
  // is_weight; docs/math.md section 8).
  T loss_factor = linear ? -adv * is_weight : T(0);
  out.loss = linear ? T(0) : policy * is_weight;
  // cispo, vespo: no gradient through their stop-gradient ratio weights, not even 0 * a non-finite is_weight (NaN)
  constexpr bool kStopsRatioGrad = kFamily == PolicyFamily::kCispo || kFamily == PolicyFamily::kVespo;
  out.dloss_drho = kStopsRatioGrad ? T(0) : dpolicy_drho * is_weight;
  out.token_dl = dpolicy_dl * is_weight;
  out.token_drho = out.dloss_drho;
  out.kl = T(0);

  if constexpr (kKL != KLKind::kNone) {
    poison += l_ref - l_ref;
    const KLTerms<T> k = kl_terms_t<T, kKL>(c, l, l_ref);
    if constexpr (kBias) {  // bias correction (DeepSeek-V3.2): KL * rho, rho carrying its gradient
      // The limits of a large finite rho where rho overflowed: a factor exactly 0 (KL = 0 at l_ref == l, a KL
      // gradient a clamp cut) makes its product 0, not 0 * inf = NaN (docs/math.md section 8)
      out.kl = k.kl == T(0) ? T(0) : rho * k.kl;
      out.dloss_drho += c.beta * k.kl;
      out.token_drho += c.beta * k.kl_and_slope;
      loss_factor += c.beta * k.kl;
    } else {
      out.kl = k.kl;
      out.token_dl += c.beta * k.dkl_dl;
      out.loss += c.beta * k.kl;
    }
  }
  out.loss += through_ratio_exp(loss_factor, rho);
  out.loss += poison;
  out.kl += poison;
  out.token_dl += poison;
  if constexpr (!kStopsRatioGrad || (kKL != KLKind::kNone && kBias)) {
    out.dloss_drho += poison;  // cispo's and vespo's ratios are stop-gradient weights: no gradient flows through them
    out.token_drho += poison;
  }

  clip_flags(c, rho, adv, &out.low, &out.high, &out.cispo_clipped);
  return out;
}

// token_terms_t as a callable type, so that one dispatch hands a loop the right instantiation.
template <typename T, PolicyFamily kFamily, KLKind kKL, bool kBias>
struct TokenTermsFn {
  GRPO_HD TokenTerms<T> operator()(const TokenConsts<T>& c, T l, T l_ref, T adv, T is_weight, T rho) const {
    return token_terms_t<T, kFamily, kKL, kBias>(c, l, l_ref, adv, is_weight, rho);
  }
};

template <typename T, PolicyFamily kFamily, bool kBias, typename Fn>
GRPO_HD void dispatch_kl(KLKind kl, Fn&& fn) {
  switch (kl) {
    case KLKind::kNone: fn(TokenTermsFn<T, kFamily, KLKind::kNone, false>{}); break;
    case KLKind::kK1: fn(TokenTermsFn<T, kFamily, KLKind::kK1, kBias>{}); break;
    case KLKind::kK2: fn(TokenTermsFn<T, kFamily, KLKind::kK2, kBias>{}); break;
    case KLKind::kK3: fn(TokenTermsFn<T, kFamily, KLKind::kK3, kBias>{}); break;
    case KLKind::kAbs: fn(TokenTermsFn<T, kFamily, KLKind::kAbs, kBias>{}); break;
    case KLKind::kK1Plus: fn(TokenTermsFn<T, kFamily, KLKind::kK1Plus, kBias>{}); break;
    case KLKind::kK3Plus: fn(TokenTermsFn<T, kFamily, KLKind::kK3Plus, kBias>{}); break;
    case KLKind::kLowVarKL: fn(TokenTermsFn<T, kFamily, KLKind::kLowVarKL, kBias>{}); break;
  }
}

template <typename T, PolicyFamily kFamily, typename Fn>
GRPO_HD void dispatch_bias(KLKind kl, bool bias_correction, Fn&& fn) {
  if (bias_correction) {
    dispatch_kl<T, kFamily, true>(kl, fn);
  } else {
    dispatch_kl<T, kFamily, false>(kl, fn);
  }
}

// Runs fn(TokenTermsFn<T, family, kl, bias>{}) for the runtime choice: one switch per row or kernel, not per token.
template <typename T, typename Fn>
GRPO_HD void dispatch_token_terms(PolicyFamily family, KLKind kl, bool bias_correction, Fn&& fn) {
  switch (family) {
    case PolicyFamily::kClip: dispatch_bias<T, PolicyFamily::kClip>(kl, bias_correction, fn); break;
    case PolicyFamily::kCispo: dispatch_bias<T, PolicyFamily::kCispo>(kl, bias_correction, fn); break;
    case PolicyFamily::kSapo: dispatch_bias<T, PolicyFamily::kSapo>(kl, bias_correction, fn); break;
    case PolicyFamily::kVespo: dispatch_bias<T, PolicyFamily::kVespo>(kl, bias_correction, fn); break;
  }
}

// The same for a choice made at run time (a per-token switch: fine where memory bandwidth is the limit).
template <typename T>
GRPO_HD TokenTerms<T> token_terms(const TokenConsts<T>& c, PolicyFamily family, KLKind kl, bool bias_correction, T l,
                                  T l_ref, T adv, T is_weight, T rho) {
  TokenTerms<T> out;
  dispatch_token_terms<T>(family, kl, bias_correction,
                          [&](auto terms) { out = terms(c, l, l_ref, adv, is_weight, rho); });
  return out;
}

// At the sequence level, whether a row's only kept token holds the row's whole count (m = n >= 1): the row's ratio is
// then the token's own, and its summed factor of rho takes token_drho (the token level's, where k3's KL + dKL/dl is
// exact) in place of dloss_drho, with no own KL path added after (docs/math.md section 8).
GRPO_HD bool ratio_is_the_lone_tokens(bool sequence_level, double kept_tokens, double mask_sum) {
  return sequence_level && kept_tokens == 1.0 && mask_sum >= 1.0;
}

// dP/dl of a token whose ratio is its own, rho = exp(l - l_old) (every level but the sequence's).
template <typename T>
GRPO_HD T token_level_grad(const TokenTerms<T>& tt, T rho) {
  return tt.token_dl + through_ratio_exp(tt.token_drho, rho);
}

// The global factor applied to the sum of row partials (and, in backward, to the raw gradient). `non_empty_rows`:
// the rows with a kept token, which replace B in the per-row means when skip_empty_rows is set.
template <typename T>
GRPO_HD T global_loss_scale(const LossParams& p, int64_t batch, int64_t max_completion_length, T mask_total,
                            T non_empty_rows, bool has_num_items, T num_items, T loss_scale) {
  const T count = mask_total > T(1) ? mask_total : T(1);
  const T rows = p.skip_empty_rows ? (non_empty_rows > T(1) ? non_empty_rows : T(1)) : T(batch);
  T denom;
  switch (p.loss_type) {
    case LossType::kBNPO: denom = count; break;
    case LossType::kDrGRPO: denom = rows * T(max_completion_length); break;
    case LossType::kDAPO:
    case LossType::kCISPO:
    case LossType::kVESPO: denom = has_num_items ? num_items : count; break;
    default: denom = rows; break;  // grpo, sapo, luspo
  }
  return loss_scale / denom;
}

// Batch totals of the row partials (summed by the caller in a fixed order) -> loss, metrics and the gradient scale.
template <typename T>
GRPO_HD void finalize_loss(const LossParams& p, const T* totals, int64_t batch, int64_t max_completion_length,
                           bool has_num_items, T num_items, T loss_scale, T* loss_out, T* metrics_out,
                           T* grad_scale_out) {
  const T mask_total = totals[kSlotMask];
  const T scale = global_loss_scale(p, batch, max_completion_length, mask_total, totals[kSlotNonEmpty], has_num_items,
                                    num_items, loss_scale);
  *loss_out = totals[kSlotLoss] * scale;
  *grad_scale_out = scale;
  const T token_count = mask_total > T(1) ? mask_total : T(1);
  const T share_denom = p.row_share_metrics ? T(batch) : token_count;
  metrics_out[kMetricKL] = totals[kSlotKL] / token_count;
  metrics_out[kMetricLow] = totals[kSlotLow] / share_denom;
  metrics_out[kMetricHigh] = totals[kSlotHigh] / share_denom;
  metrics_out[kMetricRegion] = totals[kSlotRegion] / share_denom;
  metrics_out[kMetricCispo] = totals[kSlotCispo] / share_denom;
  metrics_out[kMetricVespoPhi] = totals[kSlotPhi] / (p.per_row_advantages ? T(batch) : token_count);
}

}  // namespace grpo_ext
