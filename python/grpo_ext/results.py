"""The result types every implementation of the ops returns (the kernels' wrappers and :mod:`grpo_ext.reference`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["GRPOLossOutput", "GroupAdvantages", "SelectiveLogSoftmax"]


class GroupAdvantages(NamedTuple):
    """Output of :func:`group_advantages`.

    Attributes:
        advantages: ``[B]`` per-completion advantage, never NaN.
        group_mean: ``[B/G]`` NaN-aware mean of the combined reward R over each group (0 for a group with no
            scored member).
        group_std: ``[B/G]`` NaN-aware std (``std_ddof``) of R over each group, whatever ``scale_rewards`` is;
            0 for a group with fewer than ``std_ddof + 1`` scored members.
        zero_std: ``[B/G]`` bool, true iff the group has at least 2 scored members and ``group_std <= 1e-8``.
    """

    advantages: Tensor
    group_mean: Tensor
    group_std: Tensor
    zero_std: Tensor


class GRPOLossOutput(NamedTuple):
    """Output of :func:`grpo_loss`.

    Attributes:
        loss: 0-dim loss (already multiplied by ``loss_scale``), carrying the gradient w.r.t. ``logps``.
        metrics: detached 0-dim tensors in the compute dtype: ``"kl"`` (only when ``beta != 0``), and
            ``"clip_ratio/low_mean"``, ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"`` (every loss type but
            cispo) or ``"cispo_clip_ratio"`` (cispo only).
    """

    loss: Tensor
    metrics: dict[str, Tensor]


class GRPOLossTokenOutput(NamedTuple):
    """Output of the fused losses (:func:`grpo_loss_from_logits`, :func:`grpo_loss_from_hidden`) called with
    ``return_token_logps=True``: :class:`GRPOLossOutput`'s fields, then what the fused pass computed per token.

    Attributes:
        loss: as :class:`GRPOLossOutput`.
        metrics: as :class:`GRPOLossOutput`, with ``"entropy"``.
        token_logps: ``[B, T]`` detached log-probs of the completion ids under the loss' distribution (after the
            logits options), in the compute dtype; 0 where ``completion_mask * sample_mask`` is 0 (never read).
        token_entropy: ``[B, T]`` detached entropy of each token's distribution, 0 at the tokens never read.
    """

    loss: Tensor
    metrics: dict[str, Tensor]
    token_logps: Tensor
    token_entropy: Tensor


class SelectiveLogSoftmax(NamedTuple):
    """Per-token log-probs of the chosen ids, and the entropy of each row's distribution (None unless asked)."""

    logps: Tensor
    entropy: Tensor | None
