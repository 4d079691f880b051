"""Helpers shared by the op modules: the dtype the kernels accumulate in, the double-backward guard, and the eager
calls' way past the autograd key."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (the kernels' statistics and gradient dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def refuse_double_backward(function: str) -> None:
    """Raises RuntimeError when a backward runs with ``create_graph=True``.

    The ops' gradients come from kernels that are not themselves differentiable, so a gradient of the gradient (a
    gradient penalty, for instance) would silently be zero. Grad mode is on inside a backward exactly when the
    caller asked for ``create_graph=True``.
    """
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"grpo_ext.{function} does not support double backward (create_graph=True): its gradient is computed "
            f"by a kernel that autograd cannot differentiate. Use grpo_ext.reference.{function} for that."
        )


def refuse_function_transforms(function: str) -> None:
    """Raises RuntimeError naming the op when a torch.func transform (grad, jacrev, vjp, vmap over a gradient) is
    active where the op would compute its gradient: the fused kernel computes it in the forward, which torch.func
    cannot trace (torch's own message names neither the op nor a way out)."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            f"grpo_ext.{function} does not support torch.func's transforms (grad, jacrev, vjp, hessian) where it "
            "computes a gradient: its fused kernel forms the gradient in the forward pass. Use torch.autograd "
            f"(loss.backward(), torch.autograd.grad), or grpo_ext.reference.{function}, which supports them."
        )


def refuse_forward_mode(function: str, *inputs: Tensor | None) -> None:
    """Raises RuntimeError naming the op when one of its differentiable ``inputs`` carries a forward-mode tangent
    (torch.func.jvp, jacfwd, hessian's outer pass, torch.autograd.forward_ad): the kernels have no forward derivative,
    and the call would drop the tangent, a zero derivative given silently (an outside check, 2026-11-29)."""
    if forward_ad._current_level < 0:  # no dual level open: nothing carries a tangent (one attribute read)
        return
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in inputs):
        raise RuntimeError(
            f"grpo_ext.{function} does not support forward-mode AD (torch.func.jvp, jacfwd, hessian, "
            "torch.autograd.forward_ad): its kernels have no forward derivative, and the tangent would be dropped. "
            f"Use reverse mode (loss.backward(), torch.autograd.grad), or grpo_ext.reference.{function}, which "
            "supports both."
        )


#: ``with below_autograd():`` calls ops past the autograd dispatch key, as torch.library's autograd wrapper does itself
#: where no gradient is needed: the ops' eager paths use it where grad mode is off (never under torch.compile), so
#: that a call does not go through that wrapper's Python on its way to the kernel.
below_autograd = torch._C._AutoDispatchBelowAutograd
