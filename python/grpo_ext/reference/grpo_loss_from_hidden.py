"""Reference of grpo_loss_from_hidden: the materialized LM-head logits, then grpo_loss_from_logits."""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import GRPOLossOutput, GRPOLossTokenOutput
from ..validation.logits import check_rows_as_mask
from ..validation.options import takes_loss_options
from ..validation.values import check_compute_dtype
from .grpo_loss_from_logits import grpo_loss_from_logits, kept_tokens


@takes_loss_options
def grpo_loss_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    return_token_logps: bool = False,
    **options,
) -> GRPOLossOutput | GRPOLossTokenOutput:
    """``logits = hidden @ lm_head_weight.T (+ lm_head_bias)``, then :func:`grpo_loss_from_logits`.

    It takes every argument of :func:`grpo_ext.grpo_loss_from_hidden`, so that a call to the op runs unchanged here.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]``.
        lm_head_weight: ``[V, H]``.
        completion_ids: ``[B, T]`` (or ``[N]``).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        lm_head_bias: ``[V]`` or None.
        temperature: > 0.
        logit_scale: multiplies the raw logits first; finite, > 0 (docs/math.md section 2).
        logit_softcap: ``logit_softcap * tanh(y / logit_softcap)`` of the scaled logits ``y``, or None.
        entropy_coef: the entropy bonus, as :func:`grpo_loss_from_logits`'.
        entropy_weights: the bonus' token weights, as :func:`grpo_loss_from_logits`'.
        chunk_size: ignored (the reference materializes every logit).
        compute_dtype: the dtype of the matmul and the rest (``torch.bfloat16``, say), or None: ``hidden``'s. Given,
            ``hidden``, ``lm_head_weight`` and ``lm_head_bias`` are cast to it first, as autocast does, and autograd
            casts each gradient back to its tensor's dtype.
        return_token_logps: also return the ``[B, T]`` log-probs and entropies (detached; 0 where not kept), as a
            :class:`~grpo_ext.GRPOLossTokenOutput`.
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there).

    Returns:
        GRPOLossOutput, with ``metrics["entropy"]``; a GRPOLossTokenOutput with ``return_token_logps=True``.
    """
    compute_dtype = check_compute_dtype(compute_dtype)
    if compute_dtype is not None:
        hidden, lm_head_weight = hidden.to(compute_dtype), lm_head_weight.to(compute_dtype)
        lm_head_bias = None if lm_head_bias is None else lm_head_bias.to(compute_dtype)
    check_rows_as_mask("hidden", hidden, completion_mask)
    # Masked rows are never read: NaN hidden states there must reach neither gradient (0 * NaN is NaN in a matmul).
    keep = kept_tokens(completion_mask, options.get("sample_mask")).reshape(*hidden.shape[:-1], 1)
    hidden = torch.where(keep, hidden, 0.0)
    logits = hidden @ lm_head_weight.t()
    if lm_head_bias is not None:
        logits = logits + lm_head_bias
    return grpo_loss_from_logits(
        logits, completion_ids, advantages, completion_mask, temperature=temperature, logit_scale=logit_scale,
        logit_softcap=logit_softcap, entropy_coef=entropy_coef, entropy_weights=entropy_weights,
        return_token_logps=return_token_logps, **options
    )
