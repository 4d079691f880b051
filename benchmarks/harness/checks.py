"""The agreement check: a peer's result against the float64 reference, before any timing; a peer that disagrees
becomes an n/a row with the reason (:func:`check_peer`), the run goes on. Where the peer is grpo_ext's own op, the
run then fails once its record is written (:func:`fail_if_grpo_ext_disagreed`): a wrong kernel must never leave a
green benchmark run, and a GPU session must not lose the other rows to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .peers import short_reason

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


def check_peer(
    name: str, steps: dict[str, Any], notes: dict[str, str], compare: Callable[[], float], case: str = ""
) -> float | None:
    """Runs one peer's agreement checks; a peer that disagrees is never timed and never stops the run.

    Args:
        name: the peer (a key of ``steps``).
        steps: name -> call, or None when unavailable. On a mismatch ``steps[name]`` becomes None (not timed).
        notes: name -> why it is unavailable. On a mismatch ``notes[name]`` says which check failed and by how much.
        compare: the peer's comparisons (e.g. :func:`assert_matches` calls), returning the largest error and raising
            AssertionError on a mismatch.
        case: the case's label, for the printed line.

    Returns:
        What ``compare`` returned, or None when the peer disagrees (its row is then n/a with the reason).
    """
    try:
        return compare()
    except AssertionError as exc:
        steps[name] = None
        notes[name] = f"disagrees with the float64 reference: {short_reason(exc, limit=300)}"
        print(f"  [{case}] {name} n/a: {notes[name]}")
        if name.startswith("grpo_ext"):
            GRPO_EXT_DISAGREED.append(f"{case} {name}".strip())
        return None


# The cases where one of grpo_ext's own rows disagreed with the reference, in this process.
GRPO_EXT_DISAGREED: list[str] = []


def fail_if_grpo_ext_disagreed() -> None:
    """Exits with status 1, naming the cases, when grpo_ext's own op disagreed with the reference in this run."""
    if GRPO_EXT_DISAGREED:
        raise SystemExit(f"grpo_ext disagreed with the float64 reference in: {'; '.join(GRPO_EXT_DISAGREED)}")
