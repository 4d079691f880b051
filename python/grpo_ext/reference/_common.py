"""Helpers of the reference ops: the compute dtype, the logits options and NaN-aware group statistics."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.options import LogitOptions


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype arithmetic runs in: ``t``'s dtype promoted to at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def transform_logits(logits: Tensor, logit: LogitOptions) -> Tensor:
    """``z`` of docs/math.md section 2 in the compute dtype: scale, then the soft-cap, then the temperature."""
    y = logits.to(compute_dtype(logits)) * logit.logit_scale
    if logit.logit_softcap is not None:
        y = logit.logit_softcap * torch.tanh(y / logit.logit_softcap)
    return y / logit.temperature


def nan_mean_std(x: Tensor, std_ddof: int) -> tuple[Tensor, Tensor, Tensor]:
    """NaN-aware mean and std over the last dimension; NaN entries are "not scored".

    Args:
        x: ``[..., N]`` floating tensor, NaN marking entries to ignore.
        std_ddof: delta degrees of freedom of the std (1 = Bessel).

    Returns:
        ``(mean, std, count)``, each ``[...]``: ``mean`` is the mean of the scored entries (0 when none is scored),
        ``std`` is ``sqrt(sum (x - mean)^2 / (count - std_ddof))`` over the scored entries, and 0 (not NaN) when
        ``count < std_ddof + 1``; ``count`` (int64) is the number of scored entries.
    """
    scored = ~torch.isnan(x)
    count = scored.sum(dim=-1)
    values = torch.where(scored, x, torch.zeros_like(x))
    mean = values.sum(dim=-1) / count.clamp(min=1).to(x.dtype)
    squared_dev = torch.where(scored, (values - mean.unsqueeze(-1)) ** 2, torch.zeros_like(x))
    variance = squared_dev.sum(dim=-1) / (count - std_ddof).clamp(min=1).to(x.dtype)
    std = torch.where(count >= std_ddof + 1, variance.sqrt(), torch.zeros_like(variance))
    return mean, std, count


def per_row(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Detached ``[B]``/``[B,1]``/``[B,T]`` tensor as ``[B,1]`` or ``[B,T]`` in ``dtype`` (for broadcasting)."""
    t = t.detach().to(dtype)
    return t.unsqueeze(1) if t.dim() == 1 else t
