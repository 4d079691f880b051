"""Reference of selective_log_softmax (docs/math.md section 2), through a materialized log_softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import SelectiveLogSoftmax
from ..validation import validate_selective_log_softmax_args
from ..validation.options import LogitOptions
from ._common import compute_dtype, transform_logits


def selective_log_softmax(
    logits: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> SelectiveLogSoftmax:
    """Log-probs of the chosen tokens and the entropy (docs/math.md section 2), through a materialized log_softmax.

    ``z = softcap(logit_scale * logits) / temperature``; ``logps = z[id] - logsumexp(z)``;
    ``entropy = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args:
        logits: ``[..., V]`` floating; ``logits[..., :]`` scores ``ids[...]`` (positions already aligned).
        ids: ``[...]`` integer token ids in ``[0, V)``.
        temperature: > 0.
        logit_scale: multiplies the logits first; finite, > 0.
        logit_softcap: ``logit_softcap * tanh(y / logit_softcap)`` of the scaled logits ``y``, or None.
        return_entropy: also return the entropy.

    Returns:
        :class:`SelectiveLogSoftmax` of ``[...]`` tensors in the compute dtype (float32, float64 for float64
        logits), differentiable with respect to ``logits``.
    """
    logit = validate_selective_log_softmax_args(logits, ids, temperature, logit_scale, logit_softcap, return_entropy)
    x = logits.to(compute_dtype(logits))
    logps, entropy = _ZeroUpstreamRowsAreInert.apply(x, ids.long(), logit)
    return SelectiveLogSoftmax(logps, entropy if return_entropy else None)


def _materialized(x: Tensor, ids: Tensor, logit: LogitOptions) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of raw logits ``x`` through a materialized log_softmax (autograd differentiates it)."""
    log_probs, probs, finite_log_probs = _softmax_of(x, logit)
    logps = torch.gather(log_probs, -1, ids.unsqueeze(-1)).squeeze(-1)
    return logps, -(probs * finite_log_probs).sum(-1)


def _softmax_of(x: Tensor, logit: LogitOptions) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p, p, log p with 0 where p = 0)`` of raw logits ``x``. 0 * log 0 = 0: a -inf logit (a vocabulary entry
    masked out) contributes nothing, and nothing to the gradient either (log 0 is replaced before the product, so no
    0 * inf); a NaN row stays NaN."""
    log_probs = torch.log_softmax(transform_logits(x, logit), dim=-1)
    probs = log_probs.exp()
    return log_probs, probs, torch.where(probs == 0, torch.zeros_like(log_probs), log_probs)


class _ZeroUpstreamRowsAreInert(torch.autograd.Function):
    """:func:`_materialized` whose rows with no upstream gradient get an exactly zero gradient (docs/math.md,
    "Non-finite inputs"), whatever their logits hold: autograd alone would give 0 * NaN = NaN there.

    The other rows' gradient is autograd's vector-Jacobian product of :func:`_materialized`, unchanged; the
    forward-mode derivative (torch.func.jvp, jacfwd, hessian) is :func:`_materialized`'s own.
    """

    generate_vmap_rule = True  # pure torch: torch.func.vmap (and so jacrev, hessian) batches it

    @staticmethod
    def forward(x: Tensor, ids: Tensor, logit: LogitOptions) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return _materialized(x, ids, logit)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # separate: torch.func's transforms need it
        x, ids, logit = inputs
        ctx.save_for_backward(x, ids)
        ctx.save_for_forward(x, ids)
        ctx.logit = logit

    @staticmethod
    def backward(ctx, grad_logps: Tensor, grad_entropy: Tensor) -> tuple[Tensor, None, None]:
        x, ids = ctx.saved_tensors
        inert = ((grad_logps == 0) & (grad_entropy == 0)).unsqueeze(-1)
        # an inert row's logits replaced by finite ones: its product is 0 * finite, then set to exactly 0
        _, vjp = torch.func.vjp(lambda t: _materialized(t, ids, ctx.logit), torch.where(inert, 0.0, x))
        (grad,) = vjp((grad_logps, grad_entropy))
        return torch.where(inert, 0.0, grad), None, None

    @staticmethod
    def jvp(ctx, x_tangent: Tensor, ids_tangent: None, logit_tangent: None) -> tuple[Tensor, Tensor]:
        x, ids = ctx.saved_tensors
        return _materialized_tangents(x, x_tangent, ids, ctx.logit)


def _materialized_tangents(x: Tensor, x_tangent: Tensor, ids: Tensor, logit: LogitOptions) -> tuple[Tensor, Tensor]:
    """The forward-mode derivative of :func:`_materialized` along ``x_tangent``, written out (a nested torch.func.jvp
    would fail under torch.autograd.forward_ad): ``z' = dz/dx * x'``, ``logp' = z'[id] - E_p[z']`` and
    ``H' = -sum_v p_v (z'_v - E_p[z']) log p_v`` (``p log p`` taken as 0 where ``p = 0``, as in the forward)."""
    y = x * logit.logit_scale
    slope = torch.full_like(x, logit.logit_scale / logit.temperature)
    if logit.logit_softcap is not None:
        slope = slope * (1 - torch.tanh(y / logit.logit_softcap) ** 2)
    z_tangent = x_tangent * slope
    _, probs, finite_log_probs = _softmax_of(x, logit)
    centered = z_tangent - (probs * z_tangent).sum(-1, keepdim=True)
    logps = torch.gather(centered, -1, ids.unsqueeze(-1)).squeeze(-1)
    return logps, -(probs * centered * finite_log_probs).sum(-1)
