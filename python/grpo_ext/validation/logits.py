"""Checks of selective_log_softmax's arguments, shared by its kernel's wrapper and its reference, and of the fused
losses' token rows against their ids and mask. Part of
:mod:`grpo_ext.validation`; the logits options themselves are checked by
:func:`~grpo_ext.validation.values.validate_logit_options`."""

from __future__ import annotations

import torch
from torch import Tensor

from .options import LogitOptions
from .tensors import check_floating, check_integer, check_same_device, check_tensor
from .values import check_bool, validate_logit_options


def validate_selective_log_softmax_args(
    logits: Tensor,
    ids: Tensor,
    temperature: float,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> LogitOptions:
    """Checks selective_log_softmax's arguments (shared with the native op's wrapper); returns the logits options.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    check_tensor("logits", logits)
    check_tensor("ids", ids)
    check_floating("logits", logits)
    check_integer("ids", ids)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [N, V] or [B, T, V], got {tuple(logits.shape)}")
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"ids must have shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(ids.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least one entry (V >= 1)")
    check_same_device("logits", logits, ids=ids)
    check_bool("return_entropy", return_entropy)
    return validate_logit_options(temperature, logit_scale, logit_softcap)


def check_ids_and_mask(rows: int, device: torch.device, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Checks ids and mask against ``rows`` scoring rows; returns the ids flattened to ``[N]``."""
    if not isinstance(completion_mask, Tensor) or completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be a [B, T] tensor, got {getattr(completion_mask, 'shape', None)}")
    batch, length = completion_mask.shape
    if rows != batch * length:
        raise ValueError(f"there are {rows} token rows, but completion_mask [B, T]={(batch, length)} has "
                         f"{batch * length}")  # fmt: skip
    if not isinstance(completion_ids, Tensor):
        raise ValueError(f"completion_ids must be an int64 (or int32) tensor, got {type(completion_ids).__name__}")
    check_integer("completion_ids", completion_ids)
    if (completion_ids.numel() != rows or completion_ids.dim() not in (1, 2)
            or (completion_ids.dim() == 2 and tuple(completion_ids.shape) != (batch, length))):  # fmt: skip
        raise ValueError(f"completion_ids must have shape [B, T]={(batch, length)} or [N]=({rows},), "
                         f"got {tuple(completion_ids.shape)}")  # fmt: skip
    if completion_ids.device != device or completion_mask.device != device:
        raise ValueError(f"completion_ids and completion_mask must be on device {device}")
    return completion_ids.reshape(-1)


def check_rows_as_mask(name: str, rows: Tensor, completion_mask: Tensor) -> None:
    """Raises ValueError unless 3-D ``rows`` (logits ``[B, T, V]``, hidden states ``[B, T, H]``) have the ``[B, T]``
    of a 2-D ``completion_mask``: a ``[T, B, ...]`` layout has the right number of rows, in the wrong order. Flat
    ``[N, ...]`` rows, and a mask that is not 2-D (its own check names it), pass."""
    if rows.dim() != 3 or not isinstance(completion_mask, Tensor) or completion_mask.dim() != 2:
        return
    if tuple(rows.shape[:2]) != tuple(completion_mask.shape):
        last = "V" if name == "logits" else "H"
        raise ValueError(f"{name} must have shape [B, T, {last}] with [B, T]={tuple(completion_mask.shape)} "
                         f"(completion_mask's), got {tuple(rows.shape)}")  # fmt: skip


def check_rows_disjoint(name: str, logits: Tensor) -> None:
    """Raises ValueError unless the rows (last dimension) of ``logits`` ``[..., V]`` lie in disjoint memory, so that a
    kernel may write each row's gradient over it (``inplace_grad``) without two blocks writing one row.

    The rule: taking the row dimensions by increasing stride, each stride clears the span of a row and of the
    dimensions before it. It is sufficient, and met by every layout torch makes; a stride of at least ``V`` in each
    dimension is not (sizes ``[2, 2, V]`` at strides ``[V, V, 1]`` give rows ``(0, 1)`` and ``(1, 0)`` one memory).
    The native ops check the same rule.
    """
    if logits.dim() < 2:
        return
    span = (max(logits.shape[-1], 1) - 1) * logits.stride(-1) + 1
    for stride, size in sorted((logits.stride(d), logits.shape[d]) for d in range(logits.dim() - 1)):
        if size <= 1:
            continue
        if stride < span:
            raise ValueError(f"{name} needs logits whose rows do not overlap in memory, got shape "
                             f"{list(logits.shape)} with strides {list(logits.stride())}")  # fmt: skip
        span += stride * (size - 1)
