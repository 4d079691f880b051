"""group_advantages: group-normalized advantages (docs/math.md section 1), one native kernel launch.

The op ``torch.ops.grpo_ext.group_advantages``: kernels in csrc/cuda/group_advantages.cuh and
csrc/cpu/group_advantages.cpp, planning in csrc/plan/group_advantages.h; here the typed wrapper and the fake kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..results import GroupAdvantages
from ..validation import reward_weights_tensor, validate_group_advantages_args
from ._common import accumulate_dtype


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    group_ids: Tensor | None = None,
    num_groups: int | None = None,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: str = "group",
    baseline: str = "mean",
    multi_objective_aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
    std_ddof: int = 1,
    singleton_groups: str = "zero",
) -> GroupAdvantages:
    """Group-normalized advantages (docs/math.md section 1); on CUDA a grid that grows with the groups, no host sync.

    CUDA launches: one kernel with the group std (``scale_rewards="group"`` or ``"none"``); a memset and two kernels
    with batch statistics (``"batch"``, GDPO); two more kernels with ``group_ids``, whose group counts the same one
    memset clears: at most four kernels and one memset.

    Args:
        rewards: ``[B]`` or ``[B, K]`` floating tensor (K reward functions); NaN means "not scored". The ``G``
            completions of one prompt are contiguous rows, unless ``group_ids`` says which rows form a group.
        group_size: ``G``; ``B % G`` must be 0. Exactly one of ``group_size`` and ``group_ids``.
        group_ids: ``[B]`` int64 on ``rewards``' device: the group of each row, in ``[0, num_groups)``; the rows of
            a group may be anywhere and groups may differ in size (verl's ``uid`` grouping).
        num_groups: with ``group_ids``: the number of groups; default ``max(group_ids) + 1``, which reads the ids
            (a host sync on CUDA: pass it to avoid one; required on the meta device). Out-of-range CUDA ids fail a
            device-side assert.
        reward_weights: ``K`` weights (default ones).
        scale_rewards: ``"group"`` (std of the group), ``"batch"`` (std of the batch) or ``"none"`` (Dr. GRPO).
        baseline: ``"mean"`` (GRPO) or ``"leave_one_out"`` (RLOO).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"`` (GDPO).
        eps: added to the std (never inside a sqrt).
        std_ddof: delta degrees of freedom of every std (1: Bessel, as TRL and verl).
        singleton_groups: ``"zero"`` (a group of one row is its own mean: A = 0) or ``"verl"`` (verl's mean 0 and
            std 1: A = R / (1 + eps), or R with ``scale_rewards="none"``); sum_then_normalize only (an error with
            normalize_then_sum).

    Returns:
        GroupAdvantages: ``advantages [B]``, ``group_mean [B/G]``, ``group_std [B/G]`` (float32, float64 for float64
        rewards) and ``zero_std [B/G]`` bool; ``[num_groups]`` with ``group_ids`` (a group without rows: 0, 0,
        False). No NaN ever leaves the op.

    Raises:
        ValueError: naming the bad argument and what was expected (:func:`validation.validate_group_advantages_args`).
    """
    group_size, group_ids, num_groups, eps, std_ddof = validate_group_advantages_args(
        rewards, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof, singleton_groups,
        group_ids, num_groups,
    )  # fmt: skip
    if reward_weights is not None:
        num_rewards = rewards.shape[1] if rewards.dim() == 2 else 1
        floating = isinstance(reward_weights, Tensor) and reward_weights.is_floating_point()
        weights_dtype = reward_weights.dtype if floating else torch.float64  # integer weights as a list's
        reward_weights = reward_weights_tensor(reward_weights, num_rewards, weights_dtype, rewards.device).detach()
    # The advantages are constants (no gradient reaches the rewards, as in the reference): detached inputs, so that
    # rewards that require grad do not give outputs that do, with no autograd formula behind them
    out = torch.ops.grpo_ext.group_advantages(
        rewards.detach(), reward_weights, 0 if group_size is None else group_size, scale_rewards, baseline,
        multi_objective_aggregation, eps, std_ddof, singleton_groups, group_ids, num_groups,
    )  # fmt: skip
    return GroupAdvantages(*out)


@torch.library.register_fake("grpo_ext::group_advantages")
def _group_advantages_fake(rewards, reward_weights, group_size, scale_rewards, baseline, aggregation, eps, std_ddof,
                           singleton_groups="zero", group_ids=None, num_groups=0):  # fmt: skip
    torch._check(rewards.dim() in (1, 2), lambda: f"rewards must have shape [B] or [B, K], got {tuple(rewards.shape)}")
    batch = rewards.shape[0]
    dtype = accumulate_dtype(rewards.dtype)
    if group_ids is not None:
        torch._check(tuple(group_ids.shape) == (batch,), lambda: f"group_ids must have shape [{batch}]")
        groups = num_groups
    else:
        torch._check(group_size >= 1, lambda: f"group_size must be >= 1, got {group_size}")
        torch._check(batch % group_size == 0, lambda: f"rewards.shape[0] is not divisible by group_size={group_size}")
        groups = batch // group_size
    return (
        rewards.new_empty((batch,), dtype=dtype),
        rewards.new_empty((groups,), dtype=dtype),
        rewards.new_empty((groups,), dtype=dtype),
        rewards.new_empty((groups,), dtype=torch.bool),
    )
