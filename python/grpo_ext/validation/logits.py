"""Checks of selective_log_softmax's arguments, shared by its kernel's wrapper and its reference. Part of
:mod:`grpo_ext.validation`; the logits options themselves are checked by
:func:`~grpo_ext.validation.values.validate_logit_options`."""

from __future__ import annotations

from torch import Tensor

from .options import LogitOptions
from .tensors import check_floating, check_integer, check_same_device, check_tensor
from .values import validate_logit_options


def validate_selective_log_softmax_args(
    logits: Tensor, ids: Tensor, temperature: float, logit_scale: float = 1.0, logit_softcap: float | None = None
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
    return validate_logit_options(temperature, logit_scale, logit_softcap)
