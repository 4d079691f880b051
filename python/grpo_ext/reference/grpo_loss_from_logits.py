"""Reference of grpo_loss_from_logits (docs/math.md sections 2-7): selective_log_softmax, then grpo_loss."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..results import GRPOLossOutput, GRPOLossTokenOutput
from ..validation.logits import check_ids_and_mask, check_rows_as_mask
from ..validation.options import takes_loss_options
from ..validation.values import check_bool
from .grpo_loss import grpo_loss
from .selective_log_softmax import selective_log_softmax


@takes_loss_options
def grpo_loss_from_logits(
    logits: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    inplace_grad: bool = False,
    return_token_logps: bool = False,
    **options,
) -> GRPOLossOutput | GRPOLossTokenOutput:
    """:func:`selective_log_softmax` then :func:`grpo_loss`, through a materialized log_softmax.

    It takes every argument of :func:`grpo_ext.grpo_loss_from_logits`, so that a call to the op runs unchanged here.

    Args:
        logits: ``[B, T, V]`` (or ``[N, V]`` with ``N = B * T``) floating; ``logits[i, t]`` scores
            ``completion_ids[i, t]``.
        completion_ids: ``[B, T]`` (or ``[N]``) integer ids.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        temperature: > 0.
        logit_scale: multiplies the raw logits first; finite, > 0 (docs/math.md section 2).
        logit_softcap: ``logit_softcap * tanh(y / logit_softcap)`` of the scaled logits ``y``, or None.
        entropy_coef: the entropy bonus: ``loss - entropy_coef * loss_scale * H``, ``H`` the mean entropy over the
            kept tokens, differentiated through the materialized softmax (docs/math.md section 5, "Entropy bonus").
        entropy_weights: ``[B, T]`` weights of the kept tokens in the bonus' mean, or None (every kept token).
        inplace_grad: accepted as the op takes it; the reference never writes over ``logits`` (autograd forms its
            gradient).
        return_token_logps: also return the ``[B, T]`` log-probs and entropies (detached; 0 where not kept), as a
            :class:`~grpo_ext.GRPOLossTokenOutput`.
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there).

    Returns:
        GRPOLossOutput: :func:`grpo_loss`'s, with ``metrics["entropy"]``, the mean entropy over the kept tokens; a
        GRPOLossTokenOutput with ``return_token_logps=True``.
    """
    check_rows_as_mask("logits", logits, completion_mask)
    check_ids_and_mask(math.prod(logits.shape[:-1]), logits.device, completion_ids, completion_mask)
    check_bool("inplace_grad", inplace_grad)
    return_token_logps = check_bool("return_token_logps", return_token_logps)
    batch, length = completion_mask.shape
    logits = logits.reshape(batch, length, logits.shape[-1])
    # Masked rows are never read (docs/math.md section 2): NaN there must not reach the gradient through the softmax.
    # Their ids are never read either: a padding id there (-100, or one past V) is as good as any.
    kept = kept_tokens(completion_mask, options.get("sample_mask"))
    logits = torch.where(kept.unsqueeze(-1), logits, 0.0)
    ids = completion_ids.reshape(batch, length)
    selected = selective_log_softmax(
        logits,
        torch.where(kept, ids, torch.zeros_like(ids)),
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        return_entropy=True,
    )
    out = grpo_loss(selected.logps, advantages, completion_mask, **options)
    mask = completion_mask.to(selected.logps.dtype)
    sample_mask = options.get("sample_mask")
    if sample_mask is not None:
        mask = mask * sample_mask.to(mask.dtype).unsqueeze(1)
    entropy = torch.where(mask != 0, selected.entropy, 0.0)
    entropy_mean = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    out.metrics["entropy"] = entropy_mean.detach()
    if entropy_weights is not None:
        # a masked token's weight is never read (NaN there must not reach the mean)
        weighted = torch.where(mask != 0, mask * entropy_weights.to(mask.dtype), 0.0)
        entropy_mean = (entropy * weighted).sum() / weighted.sum().clamp(min=1.0)
    if entropy_coef != 0.0:
        scale = options.get("loss_scale", 1.0)
        if isinstance(scale, torch.Tensor):
            scale = scale.detach().to(device=entropy_mean.device, dtype=entropy_mean.dtype)
        out = out._replace(loss=out.loss - entropy_coef * scale * entropy_mean.to(out.loss.dtype))
    if return_token_logps:
        token_logps = torch.where(mask != 0, selected.logps, 0.0).detach()
        return GRPOLossTokenOutput(out.loss, out.metrics, token_logps, entropy.detach())
    return out


def kept_tokens(completion_mask: Tensor, sample_mask: Tensor | None) -> Tensor:
    """``[B, T]`` bool: the tokens whose ``completion_mask * sample_mask`` is not 0 (the only ones ever read)."""
    keep = completion_mask != 0
    if sample_mask is not None:
        keep = keep & (sample_mask != 0).unsqueeze(1)
    return keep
