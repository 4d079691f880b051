"""Reference of selective_log_softmax (docs/math.md section 2), through a materialized log_softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import SelectiveLogSoftmax
from ..validation import validate_selective_log_softmax_args
from ._common import transform_logits


def selective_log_softmax(
    logits: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> SelectiveLogSoftmax:
    """Log-probs of the chosen tokens and the entropy (docs/math.md section 2), through a materialized log_softmax.

    ``z = softcap(logit_scale * logits) / temperature``; ``logps = z[id] - logsumexp(z)``;
    ``entropy = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args:
        logits: ``[..., V]`` floating; ``logits[..., :]`` scores ``ids[...]`` (positions already aligned).
        ids: ``[...]`` integer token ids in ``[0, V)``.
        temperature: > 0.
        logit_scale: multiplies the logits first; finite, > 0.
        logit_softcap: ``logit_softcap * tanh(y / logit_softcap)`` of the scaled logits ``y``, or None.
        return_entropy: also return the entropy.

    Returns:
        :class:`SelectiveLogSoftmax` of ``[...]`` tensors in the compute dtype (float32, float64 for float64
        logits), differentiable with respect to ``logits``.
    """
    logit = validate_selective_log_softmax_args(logits, ids, temperature, logit_scale, logit_softcap)
    z = transform_logits(logits, logit)
    log_probs = torch.log_softmax(z, dim=-1)
    logps = torch.gather(log_probs, -1, ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if return_entropy:
        probs = log_probs.exp()
        # 0 * log 0 = 0: a -inf logit (a vocabulary entry masked out) contributes nothing, and nothing to the
        # gradient either (log 0 is replaced before the product, so no 0 * inf); a NaN row stays NaN
        finite_log_probs = torch.where(probs == 0, torch.zeros_like(log_probs), log_probs)
        entropy = -(probs * finite_log_probs).sum(-1)
    return SelectiveLogSoftmax(logps, entropy)
