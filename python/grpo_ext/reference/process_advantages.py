"""Reference of process_advantages (docs/math.md section 1, process supervision) in plain PyTorch."""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import validate_process_advantages_args
from ._common import compute_dtype, nan_mean_std


def process_advantages(
    step_rewards: Tensor,
    step_end: Tensor,
    group_size: int,
    seq_len: int,
    *,
    eps: float = 1e-4,
    std_ddof: int = 1,
) -> Tensor:
    """Process-supervision advantages (DeepSeekMath section 4.1.3; docs/math.md section 1).

    A step ``(i, j)`` is valid iff ``step_rewards[i,j]`` is finite (NaN or +-inf: not scored) and
    ``step_end[i,j] >= 0``. All valid steps of all rows of a group are normalized together:
    ``rt = (r - mean_group) / (std_group + eps)`` (std with ``std_ddof``, 0 when fewer than ``std_ddof + 1`` valid
    steps); invalid steps get ``rt = 0``. The token advantage is
    ``A[i,t] = sum over valid j with step_end[i,j] >= t of rt[i,j]``, so tokens after the last step get 0.

    Args:
        step_rewards: ``[B, S]`` floating tensor, NaN-padded.
        step_end: ``[B, S]`` integer (int64) tensor: index of the last token of step j of row i, -1 for padding.
        group_size: ``G >= 1``; ``B`` must be divisible by it.
        seq_len: ``T >= 1``, the number of token positions of the output.
        eps: added to the group std; must be > 0.
        std_ddof: delta degrees of freedom of the std (1 = Bessel).

    Returns:
        ``[B, seq_len]`` advantages in ``step_rewards.dtype`` promoted to at least float32 (float32, or float64
        for float64 input); never NaN.

    Raises:
        ValueError: shape/dtype/device mismatches, bad ``group_size``/``seq_len``/``eps``/``std_ddof``.
    """
    group_size, seq_len, eps, std_ddof = validate_process_advantages_args(
        step_rewards, step_end, group_size, seq_len, eps, std_ddof
    )
    batch, num_steps = step_rewards.shape
    num_groups = batch // group_size

    out_dtype, dtype = compute_dtype(step_rewards), torch.float64  # the float64 formulas, as group_advantages'
    r = step_rewards.detach().to(dtype)
    valid = torch.isfinite(r) & (step_end >= 0)  # [B, S]; +-inf is not a valid step reward, like NaN
    r_valid = torch.where(valid, r, torch.full_like(r, float("nan")))  # NaN marks "not a valid step"

    # group statistics over every valid step of every row of the group
    mean, std, _ = nan_mean_std(r_valid.reshape(num_groups, group_size * num_steps), std_ddof)  # [B/G]
    mean_row = mean.repeat_interleave(group_size).unsqueeze(1)  # [B, 1]
    std_row = std.repeat_interleave(group_size).unsqueeze(1)  # [B, 1]
    rt = torch.where(valid, (r_valid - mean_row) / (std_row + eps), torch.zeros_like(r))  # [B, S]

    # A[i,t] = sum_j rt[i,j] * [step_end[i,j] >= t]
    positions = torch.arange(seq_len, device=step_rewards.device)  # [T]
    covers = step_end.unsqueeze(2) >= positions.view(1, 1, seq_len)  # [B, S, T]
    return (rt.unsqueeze(2) * covers.to(dtype)).sum(dim=1).to(out_dtype)  # [B, T]
