"""Rollout batches (dicts of ``[N, ...]`` tensors and ``N``-lists): their rows selected, their tensors mapped, and
batches of different widths concatenated (prompts left-padded, completions right-padded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def map_tensors(rows: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """``rows`` with ``fn`` applied to its tensor entries (other entries as they are)."""
    return {key: fn(value) if isinstance(value, Tensor) else value for key, value in rows.items()}


def select_rows(rollout: dict[str, Any], index: Tensor) -> dict[str, Any]:
    """The rows ``index [n]`` int64 of ``rollout`` (tensors and lists alike), in that order."""
    picked = index.tolist()
    return {
        key: [value[i] for i in picked] if isinstance(value, list) else value[index.to(value.device)]
        for key, value in rollout.items()
    }


def select_groups(rollout: dict[str, Any], keep_groups: Tensor, group: int) -> dict[str, Any]:
    """The rows of ``rollout`` whose group is marked in ``keep_groups [N / G]`` bool."""
    return select_rows(rollout, keep_groups.repeat_interleave(group).nonzero().squeeze(1))


# Padding of the [N, width] entries of rollouts and micro-batches when rows of different widths are concatenated:
# prompts on the left (generation appends on the right), completions and their per-token values on the right.
_LEFT_PAD = {"prompt_ids": None, "prompt_mask": 0}  # None: the tokenizer's pad token
_RIGHT_PAD = {"completion_ids": None, "completion_mask": False, "old_logps": 0.0, "ref_logps": 0.0}


def concat_rollouts(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate rollouts (or micro-batches) of different widths: prompts left-padded, completions right-padded.

    Entries that are None in the parts (``old_logps`` when not needed) stay None; lists are concatenated.
    """

    def pad(t: Tensor, width: int, left: bool, value: float | bool | None) -> Tensor:
        """``t [N, w]`` padded to ``[N, width]`` on the left or the right with ``value`` (None: the pad token)."""
        extra = width - t.shape[1]
        value = pad_token_id if value is None else value
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    out: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if first is None:
            out[key] = None
        elif isinstance(first, list):
            out[key] = [x for value in values for x in value]
        elif key in _LEFT_PAD or key in _RIGHT_PAD:
            left = key in _LEFT_PAD
            width = max(v.shape[1] for v in values)
            fill = _LEFT_PAD[key] if left else _RIGHT_PAD[key]
            out[key] = torch.cat([pad(v, width, left, fill) for v in values])
        else:
            out[key] = torch.cat(values)
    return out
