"""Helpers of the reference ops: the compute dtype, the logits options, NaN-aware group statistics, and the clamp,
minimum, absolute value and ratio whose gradients at bounds, ties and overflow are docs/math.md's (section 8)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..validation.options import LogitOptions


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype arithmetic runs in: ``t``'s dtype promoted to at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def transform_logits(logits: Tensor, logit: LogitOptions) -> Tensor:
    """``z`` of docs/math.md section 2 in the compute dtype: scale, then the soft-cap, then the temperature."""
    y = logits.to(compute_dtype(logits)) * logit.logit_scale
    if logit.logit_softcap is not None:
        y = logit.logit_softcap * torch.tanh(y / logit.logit_softcap)
    return y / logit.temperature


def clamp(x: Tensor, lo: float | None = None, hi: float | None = None) -> Tensor:
    """``x`` clamped to ``[lo, hi]``, whose gradient passes at the bounds (docs/math.md section 8, "Bounds and ties").

    Written with ``torch.where`` on explicit comparisons rather than ``torch.clamp``, whose gradient at a bound is a
    convention of the torch version (0 under torch 2.14.1): ``d/dx = 1`` where ``lo <= x <= hi``, 0 strictly
    outside. A NaN ``x`` stays NaN and passes its gradient. The bounds are compared in ``x``'s dtype.

    Args:
        x: floating tensor of any shape.
        lo: the lower bound, or None (none).
        hi: the upper bound, or None (none); ``lo <= hi``.

    Returns:
        The clamped tensor, ``x``'s shape and dtype.
    """
    if lo is not None:
        x = torch.where(x < lo, lo, x)
    if hi is not None:
        x = torch.where(x > hi, hi, x)
    return x


def minimum(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``min(a, b)``, whose gradient is split half/half at a tie (docs/math.md section 8).

    ``d/da = 1, d/db = 0`` where ``a < b``; ``0, 1`` where ``a > b``; ``1/2, 1/2`` where ``a == b`` (the common case in
    the clip family: a ratio inside the clip range makes both terms equal). A NaN in either gives NaN, and its
    gradient reaches both. Explicit for the same reason as :func:`clamp`.

    Args:
        a: floating tensor.
        b: floating tensor broadcastable with ``a``.

    Returns:
        The broadcast minimum.
    """
    tie = a + (b - a) * 0.5  # == a == b at a tie (no overflow), with the gradient (da + db) / 2
    return torch.where(a < b, a, torch.where(a > b, b, tie))


def absolute(x: Tensor) -> Tensor:
    """``|x|`` with the gradient ``sign(x)``: 0 at ``x = 0`` (docs/math.md section 4, ``"abs"``); a NaN ``x`` gives NaN
    and a NaN gradient (``torch.sign`` alone would give 0)."""
    sign = torch.where(torch.isnan(x), x, torch.sign(x)).detach()
    return x * sign


class _RatioExp(torch.autograd.Function):
    """``exp(d)`` whose backward keeps an exactly-zero incoming gradient 0 where ``exp(d)`` overflowed to +inf, and
    whose forward-mode derivative keeps an exactly-zero tangent 0 there (torch.func.jvp, jacfwd, hessian)."""

    generate_vmap_rule = True  # pure torch: torch.func.vmap (and so jacrev, hessian) batches it

    @staticmethod
    def forward(d: Tensor) -> Tensor:  # type: ignore[override]
        return torch.exp(d)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # separate: torch.func's transforms need it
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (rho,) = ctx.saved_tensors
        return _times_ratio(grad, rho)

    @staticmethod
    def jvp(ctx, tangent: Tensor) -> Tensor:
        (rho,) = ctx.saved_tensors
        return _times_ratio(tangent, rho)


def _times_ratio(x: Tensor, rho: Tensor) -> Tensor:
    """``x * rho``, 0 where ``x`` is exactly 0 and ``rho`` is not NaN (the limit of a large finite ``rho``); a NaN
    ratio (a non-finite input) stays visible."""
    limit_zero = (x == 0) & ~torch.isnan(rho)
    return torch.where(limit_zero, torch.zeros_like(x), x * rho)


def ratio_exp(d: Tensor) -> Tensor:
    """The importance ratio ``rho = exp(d)`` whose gradient is docs/math.md's (section 8, "An overflowing ratio").

    Where the loss's gradient reaching ``rho`` is exactly 0 (a clipped token, ``A = 0``, a capped or saturated ratio),
    the gradient reaching ``d`` is 0, also where ``rho`` overflowed to +inf: 0 for every large finite ``rho``, so
    that is the limit, where torch's ``exp`` backward would give ``0 * inf = NaN``. Double backward works (the backward
    is written in differentiable torch ops).

    Args:
        d: floating log-ratio tensor of any shape.

    Returns:
        ``exp(d)``, ``d``'s shape and dtype.
    """
    return _RatioExp.apply(d)


class _WithDerivative(torch.autograd.Function):
    """``value`` (of ``x``) whose backward is ``grad * derivative``, 0 where ``derivative`` is exactly 0 and ``grad``
    infinite; its forward-mode derivative is ``tangent * derivative`` by the same rule."""

    generate_vmap_rule = True  # pure torch: torch.func.vmap (and so jacrev, hessian) batches it

    @staticmethod
    def forward(value: Tensor, x: Tensor, derivative: Tensor) -> Tensor:  # type: ignore[override]
        return value.detach().clone()

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[2])
        ctx.save_for_forward(inputs[2])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, None]:  # type: ignore[override]
        (derivative,) = ctx.saved_tensors
        return None, _times_derivative(grad, derivative), None

    @staticmethod
    def jvp(ctx, value_tangent: Tensor | None, x_tangent: Tensor | None, derivative_tangent: Tensor | None) -> Tensor:
        (derivative,) = ctx.saved_tensors
        if x_tangent is None:  # only value or derivative carry a tangent: the output's is 0 (x is what it is of)
            return torch.zeros_like(derivative)
        return _times_derivative(x_tangent, derivative)


def _times_derivative(x: Tensor, derivative: Tensor) -> Tensor:
    """``x * derivative``, 0 where ``derivative`` is exactly 0 and ``x`` infinite (only there: a finite ``x`` keeps its
    product's graph)."""
    limit_zero = (derivative == 0) & torch.isinf(x)
    return torch.where(limit_zero, torch.zeros_like(x), x * derivative)


def with_derivative(value: Tensor, x: Tensor, derivative: Tensor) -> Tensor:
    """``f(x)`` given as its ``value`` and ``derivative = f'(x)``, whose gradient is ``grad * f'(x)``: 0 where
    ``f'(x) = 0`` even when ``grad`` is infinite (a bias-corrected KL times an overflowed ratio, docs/math.md section
    8), where autograd through ``f``'s formula would form ``inf * 0 = NaN`` or ``inf - inf``. ``derivative`` built
    from ``x`` with its graph keeps double backward working.

    Args:
        value: ``f(x)``, any shape.
        x: the input, the same shape.
        derivative: ``f'(x)``, the same shape.

    Returns:
        ``value``, differentiable with respect to ``x``.
    """
    return _WithDerivative.apply(value, x, derivative)


class _ScaledByRatio(torch.autograd.Function):
    """``kl * rho``, 0 where ``kl`` is exactly 0 (also where ``rho`` overflowed to +inf); gradients ``grad * rho``
    and ``grad * kl`` (their zeros kept by the functions they reach); forward-mode derivative ``kl' * rho + rho' *
    kl``, each product 0 where its first factor is exactly 0 (the limits of a large finite ``rho``)."""

    generate_vmap_rule = True  # pure torch: torch.func.vmap (and so jacrev, hessian) batches it

    @staticmethod
    def forward(kl: Tensor, rho: Tensor) -> Tensor:  # type: ignore[override]
        return torch.where(kl == 0, torch.zeros_like(kl), kl * rho)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        kl, rho = ctx.saved_tensors
        return grad * rho, grad * kl

    @staticmethod
    def jvp(ctx, kl_tangent: Tensor | None, rho_tangent: Tensor | None) -> Tensor:
        kl, rho = ctx.saved_tensors
        out = torch.zeros_like(kl)
        if kl_tangent is not None:
            out = out + _times_ratio(kl_tangent, rho)
        if rho_tangent is not None:
            out = out + _times_ratio(kl, rho_tangent)  # rho' = rho * d' is +inf where rho overflowed: 0 where KL is 0
        return out


def scaled_by_ratio(kl: Tensor, rho: Tensor) -> Tensor:
    """The bias-corrected KL ``rho * KL`` at the limit of a large finite ``rho`` (docs/math.md section 8): 0 where
    ``KL`` is exactly 0, whatever ``rho``; ``KL``'s gradient times ``rho`` (its zeros kept by :func:`with_derivative`),
    ``rho``'s times ``KL`` (kept by :func:`ratio_exp`). A NaN in either stays NaN.

    Args:
        kl: ``[B, T]`` KL estimate.
        rho: ``[B, T]`` importance ratio.

    Returns:
        ``[B, T]``.
    """
    return _ScaledByRatio.apply(kl, rho)


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
    # In units of a power of two near each set's largest magnitude (exact), so that neither the sum nor the squares
    # overflow, even at the dtype's largest finite values; the exponent is capped where 2^-e would be subnormal.
    cap = math.frexp(torch.finfo(x.dtype).max)[1] - 2  # 126 for float32, 1022 for float64
    exponent = torch.frexp(values.abs().amax(dim=-1, keepdim=True))[1].clamp(-cap, cap) if x.numel() else 0
    unit = torch.pow(2.0, -torch.as_tensor(exponent, dtype=x.dtype, device=x.device))
    values = values * unit
    mean = values.sum(dim=-1) / count.clamp(min=1).to(x.dtype)
    squared_dev = torch.where(scored, (values - mean.unsqueeze(-1)) ** 2, torch.zeros_like(x))
    variance = squared_dev.sum(dim=-1) / (count - std_ddof).clamp(min=1).to(x.dtype)
    std = torch.where(count >= std_ddof + 1, variance.sqrt(), torch.zeros_like(variance))
    return mean / unit.squeeze(-1), std / unit.squeeze(-1), count


def per_row(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Detached ``[B]``/``[B,1]``/``[B,T]`` tensor as ``[B,1]`` or ``[B,T]`` in ``dtype`` (for broadcasting)."""
    t = t.detach().to(dtype)
    return t.unsqueeze(1) if t.dim() == 1 else t
