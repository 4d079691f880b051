"""Shared fixtures and helpers: devices to run on, random GRPO batches, reference comparisons."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from hypothesis import settings

import grpo_ext

HAS_CUDA = torch.cuda.is_available()

# The property tests draw the same examples on every run and every machine, so that a test's verdict (CI's above all)
# depends on the change alone: a fresh-clone CI failed once on a draw no earlier run had made. `make fuzz` draws new
# examples, GRPO_EXT_FUZZ times as many per test (examples()), to look for what the fixed draws miss.
FUZZ_SCALE = int(os.environ.get("GRPO_EXT_FUZZ", "0") or 0)
settings.register_profile("reproducible", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
settings.load_profile("fuzz" if FUZZ_SCALE > 0 else "reproducible")


def examples(count: int) -> int:
    """A property test's number of examples: ``count``, times GRPO_EXT_FUZZ under `make fuzz`."""
    return count * max(FUZZ_SCALE, 1)

# tests/wheel/test_in_venv.sh runs the op tests against an installed wheel: make sure that is what they import.
if os.environ.get("GRPO_EXT_WHEEL_TEST") == "1":
    assert grpo_ext.__file__.startswith(sys.prefix), f"grpo_ext imported from {grpo_ext.__file__}, not {sys.prefix}"

# CUDA tests run wherever a GPU is visible and are skipped (only they) on machines without one.
NO_CUDA = "no CUDA device"  # the one skip reason of a test that needs a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA))]


def pytest_collection_modifyitems(items) -> None:
    """Every test that needs a CUDA device (a skipif on one) carries the ``cuda`` marker, so that ``-k cuda``
    (benchmarks/gpu_session.sh's CUDA stage and its sanitizer selection) takes it whatever its name: three such tests
    had no "cuda" in their ids and never ran there."""
    for item in items:
        if any(m.kwargs.get("reason") == NO_CUDA for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


def pytest_report_header(config) -> list[str]:
    info = grpo_ext.build_info()
    return [f"grpo_ext build: {info}", f"CUDA device: {torch.cuda.get_device_name() if HAS_CUDA else 'none'}"]


@dataclasses.dataclass
class LossBatch:
    """A random GRPO batch: G completions per prompt, random masks with an empty row and a full row."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor
    sample_mask: torch.Tensor
    policy_weights: torch.Tensor

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> LossBatch:
        def conv(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.to(device)

        return LossBatch(**{f.name: conv(getattr(self, f.name)) for f in dataclasses.fields(self)})


def make_loss_batch(
    batch: int = 8,
    seq_len: int = 9,
    *,
    group_size: int = 4,
    seed: int = 0,
    per_token_advantages: bool = False,
    ratio_spread: float = 0.3,
    dtype: torch.dtype = torch.float64,
) -> LossBatch:
    """Builds a batch whose ratios straddle the clip range and whose masks cover every row shape."""
    g = torch.Generator().manual_seed(seed)
    logps = -3.0 * torch.rand(batch, seq_len, generator=g, dtype=dtype) - 0.01
    old = logps + ratio_spread * torch.randn(batch, seq_len, generator=g, dtype=dtype)
    ref = logps + 0.2 * torch.randn(batch, seq_len, generator=g, dtype=dtype)
    mask = torch.rand(batch, seq_len, generator=g) < 0.7
    mask[0] = False  # a row with no tokens
    if batch > 1:
        mask[1] = True  # a full row
    if per_token_advantages:
        adv = torch.randn(batch, seq_len, generator=g, dtype=dtype)
    else:
        rewards = torch.rand(batch, generator=g, dtype=dtype)
        adv = grpo_ext.reference.group_advantages(rewards, group_size).advantages
    is_weights = 0.5 + torch.rand(batch, seq_len, generator=g, dtype=dtype)
    sample_mask = torch.ones(batch, dtype=torch.bool)
    sample_mask[-1] = False
    # drawn last, so that the other tensors are those of the seed as before: a quarter 0, the rest in [0.5, 1.5)
    policy_weights = torch.rand(batch, seq_len, generator=g, dtype=dtype)
    policy_weights = torch.where(policy_weights < 0.25, 0.0, 0.5 + policy_weights)
    return LossBatch(logps, old, ref, adv, mask, is_weights, sample_mask, policy_weights)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, msg: str = "",
                 equal_nan: bool = False) -> None:  # fmt: skip
    """assert_close after moving both to float64 on the CPU (the reference's dtype and device); ``equal_nan``: NaN
    where the other is NaN counts as equal."""
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(), rtol=rtol, atol=atol,
                               equal_nan=equal_nan, msg=msg or None)  # fmt: skip


def cast_kwargs(device: str | torch.device, dtype: torch.dtype, kwargs: dict) -> dict:
    """kwargs with every tensor moved to ``device``, and every floating one cast to ``dtype``."""
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype) if value.is_floating_point() else value.to(device)
        out[key] = value
    return out


@pytest.fixture
def one_thread():
    """Runs the test with torch on one thread (tiny models gain nothing from more), then restores the count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
