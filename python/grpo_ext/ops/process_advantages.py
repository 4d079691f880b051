"""process_advantages: per-token process-supervision advantages (docs/math.md section 1), one native kernel launch.

The op ``torch.ops.grpo_ext.process_advantages``: kernels in csrc/cuda/process_advantages.cuh and
csrc/cpu/process_advantages.cpp, planning in csrc/plan/process_advantages.h; here the typed wrapper and the fake.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import validate_process_advantages_args
from ._common import accumulate_dtype


def process_advantages(
    step_rewards: Tensor,
    step_end: Tensor,
    group_size: int,
    seq_len: int,
    *,
    eps: float = 1e-4,
    std_ddof: int = 1,
) -> Tensor:
    """Process-supervision token advantages (DeepSeekMath 4.1.3; docs/math.md section 1).

    Args:
        step_rewards: ``[B, S]`` floating tensor of step rewards, NaN-padded.
        step_end: ``[B, S]`` int64, index of the last token of each step (``-1`` for padding).
        group_size: ``G``; all valid step rewards of a group are normalized together.
        seq_len: ``T`` of the output.
        eps: added to the group std.
        std_ddof: delta degrees of freedom of the std.

    Returns:
        ``[B, T]`` float32 (float64 for float64 rewards): ``A[i, t]`` is the sum of the normalized rewards of the
        steps of row ``i`` that end at or after ``t``.
    """
    group_size, seq_len, eps, std_ddof = validate_process_advantages_args(
        step_rewards, step_end, group_size, seq_len, eps, std_ddof
    )
    # constants, as group_advantages' (detached: no output requiring grad without an autograd formula)
    return torch.ops.grpo_ext.process_advantages(step_rewards.detach(), step_end, group_size, seq_len, eps, std_ddof)


@torch.library.register_fake("grpo_ext::process_advantages")
def _process_advantages_fake(step_rewards, step_end, group_size, seq_len, eps, std_ddof):
    torch._check(step_rewards.dim() == 2, lambda: "step_rewards must have shape [B, S]")
    return step_rewards.new_empty((step_rewards.shape[0], seq_len), dtype=accumulate_dtype(step_rewards.dtype))
