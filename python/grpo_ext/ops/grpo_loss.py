"""grpo_loss: the fused GRPO loss, metrics and gradient from per-token log-probs (docs/math.md sections 3-7).

The ops ``torch.ops.grpo_ext.grpo_loss_forward`` / ``_backward``: kernels in csrc/cuda/grpo_loss.cuh and
csrc/cpu/grpo_loss.cpp (per-token math in csrc/grpo_loss_math.h), planning in csrc/plan/grpo_loss.h; here the typed
wrapper, the fake kernels and the autograd registration.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import GRPOLossOutput
from ..validation.loss import resolve_grpo_loss_args
from ..validation.options import takes_loss_options
from ._common import (
    accumulate_dtype,
    below_autograd,
    refuse_double_backward,
    refuse_forward_mode,
    refuse_function_transforms,
)
from .metrics import NUM_METRICS, metrics_dict

# The forward op's overload, resolved once (not through the packet on every call).
_FORWARD = torch.ops.grpo_ext.grpo_loss_forward.default


@takes_loss_options
def grpo_loss(logps: Tensor, advantages: Tensor, completion_mask: Tensor, **options) -> GRPOLossOutput:
    """Fused GRPO loss, metrics and gradient from per-token log-probs (docs/math.md sections 3-7).

    One forward kernel computes the loss, the metrics and d loss / d logps; backward only scales that gradient by
    the incoming gradient. Only ``logps`` receives a gradient.

    Args:
        logps: ``[B, T]`` float32/bfloat16/float16 (or float64) log-probs of the sampled tokens under the policy.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]`` (process supervision).
        completion_mask: ``[B, T]`` bool, integer or float mask.
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there).

    Returns:
        GRPOLossOutput: ``loss`` (0-dim float32; float64 for float64 logps) with autograd to ``logps``, and
        ``metrics`` (0-dim, detached) under TRL's names.
    """
    resolved, option_args = resolve_grpo_loss_args("grpo_loss", logps, advantages, completion_mask, options)
    refuse_forward_mode("grpo_loss", logps)
    # Only logps is differentiated: an advantages (or old_logps, ...) that requires grad must not make the loss one
    # that needs a gradient the forward did not compute.
    if not torch.is_grad_enabled() or (not logps.requires_grad and not torch.compiler.is_compiling()):
        if torch.compiler.is_compiling():
            loss, metrics_vec, _, _ = _FORWARD(logps, advantages, completion_mask, *option_args, False)
        else:  # below the autograd key: its registration would only hand the call on, at a Python round trip
            with below_autograd():
                loss, metrics_vec, _, _ = _FORWARD(logps, advantages, completion_mask, *option_args, False)
    elif logps.requires_grad and not torch.compiler.is_compiling():
        refuse_function_transforms("grpo_loss")
        loss, metrics_vec = _GRPOLossFunction.apply(logps, advantages, completion_mask, *option_args, True)
    else:  # torch.compile traces the op itself, through its register_autograd registration
        compute_grad = logps.requires_grad
        loss, metrics_vec, _, _ = _FORWARD(logps, advantages, completion_mask, *option_args, compute_grad)
    return GRPOLossOutput(loss, metrics_dict(metrics_vec, resolved))


@torch.library.register_fake("grpo_ext::grpo_loss_forward")
def _grpo_loss_forward_fake(logps, advantages, completion_mask, *args):
    compute_grad = args[-1]
    torch._check(logps.dim() == 2, lambda: "logps must have shape [B, T]")
    dtype = accumulate_dtype(logps.dtype)
    grad_shape = tuple(logps.shape) if compute_grad else (0,)
    return (
        logps.new_empty((), dtype=dtype),
        logps.new_empty((NUM_METRICS,), dtype=dtype),
        logps.new_empty(grad_shape, dtype=dtype),
        logps.new_empty((), dtype=dtype),
    )


@torch.library.register_fake("grpo_ext::grpo_loss_backward")
def _grpo_loss_backward_fake(grad_loss, grad_raw, grad_scale, out_dtype):
    return grad_raw.new_empty(grad_raw.shape, dtype=out_dtype)


def _grpo_loss_setup_context(ctx, inputs, output) -> None:
    _, metrics, grad_raw, grad_scale = output
    ctx.logps_dtype = inputs[0].dtype
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(grad_raw, grad_scale)
    ctx.mark_non_differentiable(metrics, grad_raw, grad_scale)


def _grpo_loss_backward(ctx, grad_loss, *unused_grads):
    refuse_double_backward("grpo_loss")
    grad_raw, grad_scale = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:  # another input required grad (traced under torch.compile): none flows to it
        return (None,) * ctx.num_inputs
    if grad_raw.dim() != 2:
        raise RuntimeError(
            "grpo_loss: the forward ran without computing the gradient (logps did not require grad or grad mode "
            "was off); run it again with grad enabled"
        )
    grad_logps = torch.ops.grpo_ext.grpo_loss_backward(grad_loss, grad_raw, grad_scale, ctx.logps_dtype)
    return (grad_logps,) + (None,) * (ctx.num_inputs - 1)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_forward", _grpo_loss_backward, setup_context=_grpo_loss_setup_context
)


class _GRPOLossFunction(torch.autograd.Function):
    """Eager autograd for grpo_loss_forward, the same math as the registration above.

    torch.library's autograd wrapper rebuilds the op's long schema on every call (about 0.3 ms of Python on a
    CPU); calling the op inside an autograd.Function, where grad mode is off, below the autograd key, skips it.
    """

    @staticmethod
    def forward(ctx, *op_args):
        with below_autograd():
            loss, metrics, grad_raw, grad_scale = _FORWARD(*op_args)
        _grpo_loss_setup_context(ctx, op_args, (loss, metrics, grad_raw, grad_scale))
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        return _grpo_loss_backward(ctx, grad_loss)
