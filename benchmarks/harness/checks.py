"""The agreement check: a peer's result against the float64 reference, before any timing."""

from __future__ import annotations

import torch

# Tolerances of the agreement checks, against a float64 reference run on the same (upcast) inputs. bf16 is loose
# because the eager "TRL way" does its arithmetic in bf16 (exp, min, the masked sums and their autograd).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-4, "atol_rel": 1e-4},
    torch.bfloat16: {"rtol": 3e-2, "atol_rel": 3e-2},
    torch.float16: {"rtol": 1e-2, "atol_rel": 1e-2},
    torch.float64: {"rtol": 1e-7, "atol_rel": 1e-7},
}


def assert_matches(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    scale: float | None = None,
    ignore: torch.Tensor | None = None,
) -> float:
    """Asserts ``actual`` matches the float64 ``expected`` with ``dtype``'s tolerance; returns the max abs error.

    Args:
        name: what is compared (for the error message).
        actual: the peer's tensor (any dtype; compared in float64).
        expected: the float64 reference.
        dtype: the input dtype, which sets the tolerance (:data:`TOLERANCES`).
        scale: magnitude that the absolute tolerance is relative to; default ``max|expected|`` (at least 1e-6).
        ignore: bool mask of elements left out of the comparison (where the math is legitimately discontinuous).

    Returns:
        The largest absolute difference.

    Raises:
        AssertionError: on a mismatch (the benchmark must not time wrong results).
    """
    tol = TOLERANCES[dtype]
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    if ignore is not None:
        actual = torch.where(ignore, expected, actual)
    if scale is None:
        scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-6)
    torch.testing.assert_close(
        actual, expected, rtol=tol["rtol"], atol=tol["atol_rel"] * scale, msg=lambda m: f"{name}: {m}"
    )
    return (actual - expected).abs().max().item() if actual.numel() else 0.0
