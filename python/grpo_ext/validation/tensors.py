"""Checks of tensor arguments (type, dtype, shape, device, NaN in a mask): each raises a ``ValueError`` naming the
argument and what was expected, without syncing the host with a device. Part of :mod:`grpo_ext.validation`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake


def shapes_only(t: Tensor) -> bool:
    """Whether ``t`` has shapes but no values to read: a meta tensor, or a fake one (torch's ``FakeTensorMode``, which
    tracers and memory estimators use outside torch.compile too). Value checks skip such a tensor."""
    return t.device.type == "meta" or is_fake(t)


def check_tensor(name: str, value: object) -> Tensor:
    """Raises ValueError unless ``value`` is a torch.Tensor."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` has a floating-point dtype."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_integer(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` is int64 or int32 (the index dtypes the kernels read)."""
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 (or int32) tensor, got {t.dtype}")


def check_shape(name: str, t: Tensor, allowed: Sequence[tuple[int, ...]], described: str) -> None:
    """Raises ValueError unless ``tuple(t.shape)`` is one of ``allowed``.

    Args:
        name: the argument name used in the message.
        t: the tensor to check.
        allowed: the accepted concrete shapes.
        described: the accepted shapes in symbols for the message, e.g. ``"[B,T]=(4, 7)"``.
    """
    if tuple(t.shape) not in [tuple(s) for s in allowed]:
        raise ValueError(f"{name} must have shape {described}, got {tuple(t.shape)}")


def check_per_row(name: str, t: Tensor, batch: int, length: int) -> None:
    """Raises ValueError unless ``t`` is a floating ``[B]``, ``[B,1]`` or ``[B,T]`` tensor."""
    check_floating(name, t)
    check_shape(name, t, [(batch,), (batch, 1), (batch, length)], f"[B]=({batch},), [B,1] or [B,T]={(batch, length)}")


def check_same_device(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raises ValueError if any tensor in ``others`` (None entries are skipped) is not on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on device {t.device} but {reference_name} is on device {reference.device}; "
                "all tensors must be on the same device"
            )


def check_scalar_tensor_device(name: str, t: Tensor, reference_name: str, reference: Tensor) -> None:
    """Raises ValueError unless the 0-dim tensor ``t`` is on ``reference``'s device or on the CPU (read as a number)."""
    if t.device != reference.device and t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device} but {reference_name} is on device {reference.device}; a tensor "
            f"{name} must be on {reference.device} or on the CPU"
        )


def check_finite_mask(name: str, mask: Tensor) -> None:
    """Raises ValueError if a floating-point mask on the CPU holds NaN or +-inf.

    A mask's values are 0 or 1 (or finite weights); anything else is a caller's mistake. Only CPU tensors are checked:
    reading a CUDA tensor's values would sync the host with the device, so there a non-finite entry makes the loss NaN
    instead. Under torch.compile the native op checks a CPU mask itself when it runs (a value test here would be a
    data-dependent branch in the graph).
    """
    if not mask.is_floating_point() or mask.device.type != "cpu" or torch.compiler.is_compiling() or shapes_only(mask):
        return
    if not bool(torch.isfinite(mask).all()):
        bad = mask[~torch.isfinite(mask)][0].item()
        raise ValueError(f"{name} holds {bad}; a mask's values must be finite (0 or 1, or weights)")
