"""Checks of grpo_loss_from_hidden's LM head and reference head (its wrapper's, and so
:class:`grpo_ext.nn.FusedLinearGRPOLoss`'s). Part of :mod:`grpo_ext.validation`."""

from __future__ import annotations

import torch
from torch import Tensor

from .logits import check_rows_as_mask

#: A reference LM head: (ref hidden ``[B, T, H']`` or ``[N, H']``, ref weight ``[V, H']``, ref bias ``[V]`` or None).
RefHead = tuple[Tensor, Tensor, Tensor | None]


def check_lm_head(hidden: Tensor, lm_head_weight: Tensor, lm_head_bias: Tensor | None,
                  compute_dtype: torch.dtype | None) -> int:  # fmt: skip
    """Checks the hidden states and the LM head's weight and bias (another dtype than hidden's only with a checked
    ``compute_dtype``); returns the vocabulary size V.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be a floating [B, T, H] or [N, H] tensor, got {getattr(hidden, 'shape', None)}")
    size = hidden.shape[-1]
    if size < 1:
        raise ValueError(f"hidden must have a hidden size H >= 1, got shape {tuple(hidden.shape)}")
    if not isinstance(lm_head_weight, Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != size:
        raise ValueError(f"lm_head_weight must have shape [V, H] with H={size} (hidden's), "
                         f"got {tuple(getattr(lm_head_weight, 'shape', ()))}")  # fmt: skip
    if lm_head_weight.device != hidden.device or (compute_dtype is None and lm_head_weight.dtype != hidden.dtype):
        raise ValueError(f"lm_head_weight must match hidden's dtype and device ({hidden.dtype}, {hidden.device}; "
                         f"another dtype only with compute_dtype), got {lm_head_weight.dtype}, "
                         f"{lm_head_weight.device}")  # fmt: skip
    if not lm_head_weight.is_floating_point():
        raise ValueError(f"lm_head_weight must be floating, got {lm_head_weight.dtype}")
    vocab = lm_head_weight.shape[0]
    if vocab < 1:
        raise ValueError("lm_head_weight must have at least one row (V >= 1)")
    if lm_head_bias is not None and (
        not isinstance(lm_head_bias, Tensor) or tuple(lm_head_bias.shape) != (vocab,)
        or not lm_head_bias.is_floating_point() or lm_head_bias.device != hidden.device
        or (compute_dtype is None and lm_head_bias.dtype != hidden.dtype)
    ):  # fmt: skip
        raise ValueError(f"lm_head_bias must be a floating [V]=({vocab},) tensor on hidden's device, of hidden's "
                         f"dtype unless compute_dtype is given")  # fmt: skip
    return vocab


def check_ref_head(ref_head: RefHead, rows: int, vocab: int, like: Tensor, completion_mask: Tensor) -> RefHead:
    """``ref_head`` flattened to ``[N, H']`` rows, after checking it scores the policy's N rows over the same V."""
    ref_hidden, ref_weight, ref_bias = ref_head
    if not isinstance(ref_hidden, Tensor) or not ref_hidden.is_floating_point() or ref_hidden.dim() not in (2, 3):
        raise ValueError(f"ref_input must be a floating [B, T, H] or [N, H] tensor, got "
                         f"{getattr(ref_hidden, 'shape', None)}")  # fmt: skip
    flat = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    check_rows_as_mask("ref_input", ref_hidden, completion_mask)
    if flat.shape[0] != rows or ref_hidden.device != like.device:
        raise ValueError(f"ref_input must hold the policy's {rows} token rows on {like.device}, got "
                         f"{tuple(ref_hidden.shape)} on {ref_hidden.device}")  # fmt: skip
    if (not isinstance(ref_weight, Tensor) or tuple(ref_weight.shape) != (vocab, flat.shape[1])
            or ref_weight.dtype != ref_hidden.dtype or ref_weight.device != like.device):  # fmt: skip
        raise ValueError(f"ref_weight must have shape [V, H]=({vocab}, {flat.shape[1]}) and ref_input's dtype and "
                         f"device, got {tuple(getattr(ref_weight, 'shape', ()))}")  # fmt: skip
    if ref_bias is not None and (
        not isinstance(ref_bias, Tensor) or tuple(ref_bias.shape) != (vocab,) or ref_bias.dtype != ref_hidden.dtype
        or ref_bias.device != like.device
    ):  # fmt: skip
        raise ValueError(f"ref_bias must be a [V]=({vocab},) tensor of ref_input's dtype on {like.device}, got "
                         f"{getattr(ref_bias, 'shape', type(ref_bias).__name__)} {getattr(ref_bias, 'dtype', '')} "
                         f"on {getattr(ref_bias, 'device', '-')}")  # fmt: skip
    return flat.detach().contiguous(), ref_weight.detach().contiguous(), None if ref_bias is None else ref_bias.detach()
