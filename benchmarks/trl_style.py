"""The eager peers written the way TRL 1.16's ``GRPOTrainer`` writes them, shared by several bench scripts.

* :func:`trl_style_selective_log_softmax`: the log-probs of the chosen tokens and the entropy (a metric) from the
  logits; the eager peer of ``bench_selective_log_softmax.py``, and the first half of the eager peers of
  ``bench_grpo_loss_from_logits.py`` and ``bench_grpo_loss_from_hidden.py``.
* :func:`trl_style_loss`: the clipped GRPO loss with k3 KL from log-probs; the eager peer of ``bench_grpo_loss.py``,
  and the second half of those of the two fused-loss scripts.

A peer used by one script only lives in that script (``bench_group_advantages.trl_style_advantages``).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPSILON = 0.2
MASK_DTYPE = torch.int32  # TRL builds completion_mask with .int()


def trl_style_selective_log_softmax(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probs of the chosen ids and the entropy of each row, as TRL computes them in eager PyTorch.

    ``z = logits.float() / temperature``; the log-prob is ``z[id] - logsumexp(z)`` (TRL's ``selective_log_softmax``
    for float32 logits: a gather and a logsumexp instead of a materialized ``log_softmax(z).gather(...)``, the same
    values); the entropy ``logsumexp(z) - sum_v softmax(z)_v * z_v`` is computed under ``no_grad``, as TRL logs it
    as a metric and never differentiates it.

    Args:
        logits: ``[..., V]`` in any floating dtype (upcast to float32 first).
        ids: ``[...]`` int64 token ids.
        temperature: > 0.

    Returns:
        ``(logps, entropy)``, both ``[...]`` float32; ``logps`` carries the gradient w.r.t. ``logits``.
    """
    z = logits.float() / temperature
    logps = torch.gather(z, -1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    with torch.no_grad():
        p = torch.softmax(z, dim=-1)
        entropy = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return logps, entropy


def trl_style_loss(
    logps: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str,
    beta: float,
    epsilon: float = EPSILON,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO loss with k3 KL as TRL 1.16 computes it in eager PyTorch (token-level ratio).

    Args:
        logps: ``[B, T]`` current log-probs (requires grad).
        old_logps: ``[B, T]`` sampling-policy log-probs.
        ref_logps: ``[B, T]`` reference-model log-probs.
        advantages: ``[B]``.
        completion_mask: ``[B, T]`` int mask.
        loss_type: ``"grpo"`` (per-row masked mean, then batch mean) or ``"dapo"`` (masked token mean).
        beta: KL coefficient.
        epsilon: clip range, symmetric.

    Returns:
        ``(loss, metrics)`` with metrics ``kl``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean`` as 0-dim tensors.
    """
    per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dapo":
        # TRL divides by num_items_in_batch / num_processes: on one process, the masked token count
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    else:
        raise ValueError(f"the eager peer implements grpo and dapo, not {loss_type!r}")

    completion_token_count = completion_mask.sum().clamp(min=1.0)

    def masked_batch_mean(x: Tensor) -> Tensor:
        return (x * completion_mask).sum() / completion_token_count

    is_low_clipped = (coef_1 < 1 - epsilon) & (advantages.unsqueeze(1) < 0)
    is_high_clipped = (coef_1 > 1 + epsilon) & (advantages.unsqueeze(1) > 0)
    metrics = {
        "kl": masked_batch_mean(per_token_kl),
        "clip_ratio/low_mean": masked_batch_mean(is_low_clipped.float()),
        "clip_ratio/high_mean": masked_batch_mean(is_high_clipped.float()),
        "clip_ratio/region_mean": masked_batch_mean((is_low_clipped | is_high_clipped).float()),
    }
    return loss, metrics
