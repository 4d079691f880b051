"""Reference of grpo_loss (docs/math.md sections 3-7) in plain PyTorch, its clamps, minimum and |r| explicit about
their gradients at bounds and ties (docs/math.md section 8, "Bounds and ties")."""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import GRPOLossOutput
from ..validation import validate_grpo_loss_args
from ..validation.options import (
    CLIP_FAMILY_LOSS_TYPES,
    LOW_VAR_KL_CAP,
    VESPO_LOG_RATIO_BOUND,
    VESPO_MIN_LAMBDA,
    VESPO_MIN_LOG_WEIGHT,
    LossOptions,
    takes_loss_options,
)
from ._common import absolute, clamp, compute_dtype, minimum, per_row, ratio_exp, scaled_by_ratio, with_derivative


def vespo_phi(o: LossOptions, log_w: Tensor, adv: Tensor) -> Tensor:
    """VESPO's gamma weight ``phi = exp(lambda + k * log w - lambda * w)`` (docs/math.md section 3), no gradient.

    Args:
        o: the validated options (``vespo_k_*``, ``vespo_lambda_*``).
        log_w: the rows' log-weights, broadcastable against ``adv``.
        adv: the advantages; ``A >= 0`` takes the ``_pos`` pair, ``A < 0`` (and NaN) the ``_neg`` pair.

    Returns:
        ``phi`` in the broadcast shape; 0 where it overflows to +inf (TRL's ``nan_to_num(posinf=0)``).
    """
    with torch.no_grad():
        nonneg = adv >= 0
        k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg).to(adv.dtype)
        lam = torch.where(nonneg, max(o.vespo_lambda_pos, VESPO_MIN_LAMBDA), max(o.vespo_lambda_neg, VESPO_MIN_LAMBDA))
        lam = lam.to(adv.dtype)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.where(torch.isposinf(phi), 0.0, phi)


def vespo_log_weight(d: Tensor, is_w: Tensor | None, m: Tensor) -> Tensor:
    """VESPO's row log-weight ``[B, 1]``: ``clamp(sum_t m * (clamp(d, +-20) + clamp(log is_w, log 1e-8, 20)),
    log 1e-8, 20)`` (docs/math.md section 3), no gradient. A non-finite kept ``is_w`` makes it NaN.
    """
    with torch.no_grad():
        term = torch.clamp(d.detach(), -VESPO_LOG_RATIO_BOUND, VESPO_LOG_RATIO_BOUND)
        if is_w is not None:
            term = term + torch.clamp(torch.log(is_w) + (is_w - is_w), VESPO_MIN_LOG_WEIGHT, VESPO_LOG_RATIO_BOUND)
        return torch.clamp((m * term).sum(dim=1, keepdim=True), VESPO_MIN_LOG_WEIGHT, VESPO_LOG_RATIO_BOUND)


@takes_loss_options
def grpo_loss(logps: Tensor, advantages: Tensor, completion_mask: Tensor, **options) -> GRPOLossOutput:
    """GRPO-family policy loss with optional KL penalty (docs/math.md sections 3-7).

    Steps: ``m_eff = completion_mask * sample_mask[:, None]``; positions with ``m_eff == 0`` are replaced by 0 in
    ``l``, ``l_old``, ``l_ref`` (and in per-token advantages / IS weights) before any arithmetic, so garbage there
    (even NaN or -inf) never reaches the loss or the gradient. Then ``d = l - l_old``; ``rho = exp(d)`` (token level)
    or ``rho[i,t] = exp(sum_t m_eff*d / max(n_i, 1))`` (sequence level, GSPO); the per-token term ``L`` of
    ``loss_type`` (section 3) is multiplied by ``is_weights`` (vespo: they enter its row weight instead);
    ``P = L + beta * KL`` (section 4); ``P`` is aggregated with ``m_eff`` as in section 5 and multiplied by
    ``loss_scale``.

    Args:
        logps: ``[B, T]`` floating current-policy log-probs of the sampled tokens; the only input with a gradient.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]`` floating (detached).
        completion_mask: ``[B, T]`` bool/int/float, used as a float weight (bool -> 0/1).
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there); tensors among them are detached.

    Returns:
        :class:`GRPOLossOutput`: 0-dim ``loss`` and a dict of detached 0-dim metrics, all in the compute dtype
        (``logps.dtype`` promoted to at least float32).

    Raises:
        ValueError: unknown option strings, out-of-range numbers, wrong shapes, non-floating tensors, tensors on
            different devices, an empty batch, or ``beta != 0`` without ``ref_logps``.
    """
    o = validate_grpo_loss_args(logps, advantages, completion_mask, LossOptions.from_kwargs("grpo_loss", options))
    batch, length = logps.shape

    dtype = compute_dtype(logps)

    # ------------------------------------------------------------------ masks and masked inputs
    m = completion_mask.detach().to(dtype)
    if o.sample_mask is not None:
        m = m * o.sample_mask.detach().to(dtype).unsqueeze(1)  # m_eff: [B, T]
    keep = m != 0  # [B, T] bool
    zero = torch.zeros((), dtype=dtype, device=logps.device)

    l = torch.where(keep, logps.to(dtype), zero)  # noqa: E741  (docs/math.md's symbol); gradient exactly 0 where masked
    if o.old_logps is None:
        l_old = l.detach()
    else:
        l_old = torch.where(keep, o.old_logps.detach().to(dtype), zero)

    # advantages broadcast to [B, T]; masked positions (e.g. sample-masked rows) may hold garbage, so zero them
    adv = torch.where(keep, per_row(advantages, dtype), zero)
    adv_has_token_dim = advantages.dim() == 2 and advantages.shape[1] == length and length != 1

    n = m.sum(dim=1)  # n_i: [B]

    # Non-finite inputs at kept positions ("Non-finite inputs"): a factor of NaN, not torch.where, so that the
    # gradient of such a token is NaN too. The log-ratio of a token whose l or l_old is not finite is NaN (l = -inf
    # against a finite l_old would otherwise give rho = 0 and a finite loss).
    nan = torch.full((), float("nan"), dtype=dtype, device=logps.device)
    one = torch.ones((), dtype=dtype, device=logps.device)
    ratio_bad = keep & ~(torch.isfinite(l.detach()) & torch.isfinite(l_old))
    token_bad = ratio_bad | (keep & ~torch.isfinite(adv))

    # ------------------------------------------------------------------ section 3: importance ratio
    d = (l - l_old) * torch.where(ratio_bad, nan, one)  # [B, T]
    if o.importance_sampling_level == "token":
        rho = ratio_exp(d)  # [B, T]
        log_s = None
    else:  # "sequence" (GSPO)
        log_s = (m * d).sum(dim=1) / torch.clamp(n, min=1)  # [B]
        rho = ratio_exp(log_s).unsqueeze(1).expand(batch, length)  # [B, T]; gradient reaches every token of row i

    is_w = None
    if o.is_weights is not None:
        is_w = torch.where(keep, per_row(o.is_weights, dtype), zero)  # [B, T]
        token_bad = token_bad | ~torch.isfinite(is_w)

    # ------------------------------------------------------------------ section 3: policy term L
    phi = None
    if o.loss_type == "vespo":  # is_weights enter the row's weight, not L
        phi = vespo_phi(o, vespo_log_weight(d, is_w, m), adv)  # [B, T]; NaN rows of a non-finite kept input
        token_bad = token_bad | (keep & torch.isnan(phi))
        per_token = -phi * adv * l
    elif o.loss_type in CLIP_FAMILY_LOSS_TYPES:
        rho_c = clamp(rho, hi=o.delta)  # min(rho, delta) with a constant delta: a clamp, passing at rho = delta
        clipped = clamp(rho, 1 - o.epsilon, 1 + o.epsilon_high)
        # A = 0 scores 0 whatever the ratio, an overflowed one too (inf * 0 would be NaN; section 8)
        per_token = -minimum(torch.where(adv == 0, zero, rho_c * adv), clipped * adv)
    elif o.loss_type == "cispo":
        cap = o.epsilon_high
        per_token = -clamp(rho, hi=cap).detach() * adv * l
    else:  # "sapo"
        tau = torch.where(
            adv > 0,
            torch.full_like(adv, o.sapo_temperature_pos),
            torch.full_like(adv, o.sapo_temperature_neg),
        )
        per_token = -(4 / tau) * torch.sigmoid(tau * (rho - 1)) * adv

    if is_w is not None and o.loss_type != "vespo":
        per_token = per_token * is_w
    if o.policy_weights is not None:  # on every loss type's policy term, vespo's included (after phi)
        policy_w = torch.where(keep, per_row(o.policy_weights, dtype), zero)
        token_bad = token_bad | ~torch.isfinite(policy_w)
        per_token = per_token * policy_w

    # ------------------------------------------------------------------ section 4: KL penalty
    kl = None
    if o.beta != 0:
        assert o.ref_logps is not None  # checked above
        l_ref = torch.where(keep, o.ref_logps.detach().to(dtype), zero)
        token_bad = token_bad | ~torch.isfinite(l_ref)
        r_raw = l_ref - l
        r = r_raw
        if o.kl_clamp is not None:
            r = clamp(r, -o.kl_clamp, o.kl_clamp)
        # Each estimate with its derivative stated (with_derivative): with bias correction the gradient reaching it is
        # rho times the loss's, +inf where rho overflowed, and a zero derivative must keep it 0 (section 8)
        if o.kl_estimator in ("k3", "k3+", "low_var_kl"):
            em1 = torch.expm1(r)
            kl = with_derivative(em1 - r, r, em1)  # exp(r) - r - 1
            if o.kl_estimator != "k3":  # verl clamps the k3 estimate to [-10, 10]; at exactly 10 the gradient passes
                kl = clamp(kl, -LOW_VAR_KL_CAP, LOW_VAR_KL_CAP)
        elif o.kl_estimator in ("k1", "k1+"):
            kl = -r
        elif o.kl_estimator == "abs":
            kl = with_derivative(absolute(r), r, torch.where(torch.isnan(r), r, torch.sign(r)))  # 0 at r = 0
        else:  # "k2"
            kl = with_derivative(r**2 / 2, r, r)
        if o.kl_estimator.endswith("+"):  # straight-through (verl): this value, the gradient of k2 on the raw r
            k2 = with_derivative(r_raw**2 / 2, r_raw, r_raw)
            kl = k2 - k2.detach() + kl.detach()
        if o.use_bias_correction_kl:
            kl = scaled_by_ratio(kl, rho)
        per_token = per_token + o.beta * kl

    # rho is NaN exactly where the ratio saw a non-finite input: the token's own, or at the sequence level its row's
    token_bad = token_bad | (keep & torch.isnan(rho.detach()))
    poison = torch.where(token_bad, nan, one)
    per_token = per_token * poison
    if kl is not None:
        kl = kl * poison

    # ------------------------------------------------------------------ section 5: aggregation
    weighted = per_token * m  # [B, T]
    total_tokens = torch.clamp(m.sum(), min=1)
    rows = torch.clamp((n > 0).sum(), min=1).to(dtype) if o.skip_empty_rows else batch  # section 5's B
    if o.loss_type in ("grpo", "sapo"):
        loss = (weighted.sum(dim=1) / torch.clamp(n, min=1)).sum() / rows
    elif o.loss_type == "bnpo":
        loss = weighted.sum() / total_tokens
    elif o.loss_type == "dr_grpo":
        loss = weighted.sum() / (rows * o.max_completion_length)
    elif o.loss_type in ("dapo", "cispo", "vespo"):
        if o.num_items_in_batch is None:
            denominator = total_tokens
        elif isinstance(o.num_items_in_batch, Tensor):
            denominator = o.num_items_in_batch.detach().to(device=logps.device, dtype=dtype)
        else:
            denominator = float(o.num_items_in_batch)
        loss = weighted.sum() / denominator
    else:  # "luspo"
        loss = weighted.sum() / rows
    if isinstance(o.loss_scale, Tensor):
        loss = loss * o.loss_scale.detach().to(device=logps.device, dtype=dtype)
    else:
        loss = loss * o.loss_scale

    # ------------------------------------------------------------------ section 7: metrics
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        if kl is not None:
            metrics["kl"] = (kl * m).sum() / total_tokens

        # conditions use the uncapped rho; one value per row when the ratio and the advantage are per row
        per_row_shares = o.importance_sampling_level == "sequence" and not adv_has_token_dim
        if per_row_shares:
            assert log_s is not None
            rho_cond = torch.exp(log_s)  # [B]; a row with no tokens has s_i = 1
            adv_cond = advantages.detach().to(dtype).reshape(batch)  # [B], every row counted
        else:
            rho_cond = rho  # [B, T]
            adv_cond = adv  # [B, T]

        def share(condition: Tensor) -> Tensor:
            if per_row_shares:
                return condition.to(dtype).sum() / batch
            return (condition.to(dtype) * m).sum() / total_tokens

        if o.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = share((rho_cond > o.epsilon_high) & (adv_cond > 0))
        elif o.loss_type == "vespo":  # TRL's mean of phi: over rows with one advantage per row, else over tokens
            assert phi is not None
            if adv_has_token_dim:
                metrics["vespo/phi_seq_mean"] = (phi * m).sum() / total_tokens
            else:
                log_w = vespo_log_weight(d, is_w, m).squeeze(1)
                metrics["vespo/phi_seq_mean"] = vespo_phi(o, log_w, advantages.detach().to(dtype).reshape(batch)).mean()
        else:
            low = (rho_cond < 1 - o.epsilon) & (adv_cond < 0)
            high = (rho_cond > 1 + o.epsilon_high) & (adv_cond > 0)
            metrics["clip_ratio/low_mean"] = share(low)
            metrics["clip_ratio/high_mean"] = share(high)
            metrics["clip_ratio/region_mean"] = share(low | high)

    return GRPOLossOutput(loss=loss, metrics=metrics)
