"""selective_log_softmax: log-probs (and entropy) of chosen tokens from logits (docs/math.md section 2).

The ops ``torch.ops.grpo_ext.selective_log_softmax_forward`` / ``_backward``: kernels in
csrc/cuda/selective_log_softmax.cuh and csrc/cpu/selective_log_softmax.cpp, planning in
csrc/plan/selective_log_softmax.h; here the typed wrapper, the fake kernels and the autograd registration.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import SelectiveLogSoftmax
from ..validation import validate_selective_log_softmax_args
from ._common import (
    accumulate_dtype,
    below_autograd,
    refuse_double_backward,
    refuse_forward_mode,
    refuse_function_transforms,
)


def selective_log_softmax(
    logits: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> SelectiveLogSoftmax:
    """Log-probs of the chosen tokens (and the entropy) with no ``[N, V]`` temporary (docs/math.md section 2).

    The forward reads each logits row once (CUDA: one online pass; CPU: two vectorized passes over the row); the
    backward recomputes the softmax from the saved per-row logsumexp and writes the gradient in the logits' dtype.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` float32/bfloat16/float16 (or float64); ``logits[..., :]`` scores
            ``ids[...]``, positions already aligned (the caller drops the last position).
        ids: ``[N]`` or ``[B, T]`` int64 token ids in ``[0, V)``.
        temperature: ``z = y / temperature``, > 0 (``y``: the scaled, soft-capped logits; docs/math.md section 2).
        logit_scale: ``y = logit_scale * logits`` first (Cohere's ``logit_scale``); finite, > 0.
        logit_softcap: then ``y = logit_softcap * tanh(y / logit_softcap)`` (Gemma 2's final soft-capping), or None.
        return_entropy: also return ``logsumexp(z) - sum_v softmax(z)_v z_v`` per row.

    Returns:
        SelectiveLogSoftmax: ``logps`` (and ``entropy`` or None), shaped like ``ids``, float32 (float64 for float64
        logits), differentiable with respect to the raw ``logits``.
    """
    logit = validate_selective_log_softmax_args(logits, ids, temperature, logit_scale, logit_softcap, return_entropy)
    refuse_forward_mode("selective_log_softmax", logits)
    lead_shape = ids.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = ids.reshape(-1)
    args = (flat_logits, flat_ids, *logit.op_args(), bool(return_entropy))
    if torch.is_grad_enabled() and logits.requires_grad and not torch.compiler.is_compiling():
        refuse_function_transforms("selective_log_softmax")
        logps, entropy = _SelectiveLogSoftmaxFunction.apply(*args)
    elif not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        with below_autograd():  # as in grpo_loss: past the autograd key's Python round trip
            logps, entropy, _ = torch.ops.grpo_ext.selective_log_softmax_forward(*args)
    else:
        logps, entropy, _ = torch.ops.grpo_ext.selective_log_softmax_forward(*args)
    return SelectiveLogSoftmax(logps.reshape(lead_shape), entropy.reshape(lead_shape) if return_entropy else None)


@torch.library.register_fake("grpo_ext::selective_log_softmax_forward")
def _selective_log_softmax_forward_fake(logits, ids, temperature, logit_scale, logit_softcap, return_entropy):
    torch._check(logits.dim() == 2, lambda: "logits must have shape [N, V]")
    dtype = accumulate_dtype(logits.dtype)
    rows = logits.shape[0]
    return (
        logits.new_empty((rows,), dtype=dtype),
        logits.new_empty((rows,) if return_entropy else (0,), dtype=dtype),
        logits.new_empty((rows, 3), dtype=dtype),
    )


@torch.library.register_fake("grpo_ext::selective_log_softmax_backward")
def _selective_log_softmax_backward_fake(grad_logps, grad_entropy, logits, ids, row_stats, *logit_args):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _selective_log_softmax_setup_context(ctx, inputs, output) -> None:
    logits, ids, *logit_args, _ = inputs
    row_stats = output[2]
    ctx.logit_args = tuple(logit_args)  # (temperature, logit_scale, logit_softcap)
    ctx.save_for_backward(logits, ids, row_stats)
    ctx.mark_non_differentiable(row_stats)


def _selective_log_softmax_backward(ctx, grad_logps, grad_entropy, *unused):
    refuse_double_backward("selective_log_softmax")
    logits, ids, row_stats = ctx.saved_tensors
    if grad_logps is None:
        grad_logps = torch.zeros(logits.shape[0], dtype=row_stats.dtype, device=logits.device)
    if grad_entropy is not None and grad_entropy.numel() == 0:
        grad_entropy = None
    grad_logits = torch.ops.grpo_ext.selective_log_softmax_backward(
        grad_logps, grad_entropy, logits, ids, row_stats, *ctx.logit_args
    )
    return grad_logits, None, None, None, None, None


torch.library.register_autograd(
    "grpo_ext::selective_log_softmax_forward",
    _selective_log_softmax_backward,
    setup_context=_selective_log_softmax_setup_context,
)


class _SelectiveLogSoftmaxFunction(torch.autograd.Function):
    """Eager autograd for selective_log_softmax_forward (grpo_loss._GRPOLossFunction says why not the registration)."""

    @staticmethod
    def forward(ctx, *op_args):
        with below_autograd():
            logps, entropy, row_stats = torch.ops.grpo_ext.selective_log_softmax_forward(*op_args)
        _selective_log_softmax_setup_context(ctx, op_args, (logps, entropy, row_stats))
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        return _selective_log_softmax_backward(ctx, grad_logps, grad_entropy)
