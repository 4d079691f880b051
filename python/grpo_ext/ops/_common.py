"""Helpers shared by the op modules: the dtype the kernels accumulate and return statistics in."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (the kernels' statistics and gradient dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
