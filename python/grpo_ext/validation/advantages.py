"""Checks of the advantage ops' arguments (group_advantages, process_advantages), shared by the kernels' wrappers and
the reference so that both raise the same ``ValueError``. Part of :mod:`grpo_ext.validation`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .options import BASELINES, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, SINGLETON_GROUPS
from .tensors import check_floating, check_integer, check_same_device, check_shape, check_tensor, shapes_only
from .values import check_choice, check_int, check_positive


def reward_weights_tensor(
    reward_weights: Sequence[float] | Tensor | None, num_rewards: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Returns the ``[K]`` reward weights in ``dtype`` on ``device`` (ones when None), validating the length."""
    if reward_weights is None:
        return torch.ones(num_rewards, dtype=dtype, device=device)
    if isinstance(reward_weights, Tensor) and (reward_weights.dtype == torch.bool or reward_weights.is_complex()):
        raise ValueError(f"reward_weights must hold real numbers, got a {reward_weights.dtype} tensor")
    if isinstance(reward_weights, Tensor) and reward_weights.device != device:
        raise ValueError(
            f"reward_weights is on device {reward_weights.device} but rewards is on device {device}; "
            "pass them on the rewards' device"
        )
    try:  # a list on the CPU first: its values are checked below, also for rewards on the meta device
        on = device if isinstance(reward_weights, Tensor) else "cpu"
        w = torch.as_tensor(reward_weights, dtype=dtype, device=on)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"reward_weights must be a sequence of numbers or a 1-D tensor: {err}") from None
    if w.dim() != 1:
        raise ValueError(f"reward_weights must be 1-D with K={num_rewards} entries, got shape {tuple(w.shape)}")
    if w.shape[0] != num_rewards:
        raise ValueError(f"reward_weights must have K={num_rewards} entries, got {w.shape[0]}")
    # A list's values, and a CPU tensor's, are read here. A CUDA tensor's are not (that would synchronize the host
    # with the device): there a non-finite weight makes every R_i NaN, so every row is "not scored" (docs/math.md).
    if (not isinstance(reward_weights, Tensor) or (w.device.type == "cpu" and not shapes_only(w))) and not all(
        math.isfinite(x) for x in w.tolist()
    ):
        raise ValueError(f"reward_weights must be finite numbers, got {w.tolist()}")
    return w.to(device)


def validate_group_advantages_args(
    rewards: Tensor,
    group_size: int | None,
    scale_rewards: str,
    baseline: str,
    multi_objective_aggregation: str,
    eps: float,
    std_ddof: int,
    singleton_groups: str = "zero",
    group_ids: Tensor | None = None,
    num_groups: int | None = None,
) -> tuple[int | None, Tensor | None, int, float, int]:
    """Checks group_advantages' arguments (shared with the native op's wrapper).

    Returns:
        ``(group_size, group_ids, num_groups, eps, std_ddof)``; ``num_groups`` is ``B / G`` for contiguous groups
        and, with ``group_ids``, the given number or ``max(group_ids) + 1`` (a host sync on CUDA).

    Raises:
        ValueError: naming the bad argument and what was expected; ``group_ids`` on the meta device without
            ``num_groups``, ``singleton_groups="verl"`` with ``normalize_then_sum``. The values of CUDA
            ``group_ids`` are checked only when ``num_groups`` is derived from them (the kernel asserts on the device
            otherwise).
    """
    check_tensor("rewards", rewards)
    check_floating("rewards", rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape [B] or [B,K], got {tuple(rewards.shape)}")
    if rewards.dim() == 2 and rewards.shape[1] == 0:
        raise ValueError(f"rewards has no reward column (K == 0), shape {tuple(rewards.shape)}: give at least one")
    batch = rewards.shape[0]
    if group_ids is None:
        if group_size is None:
            raise ValueError("group_advantages needs group_size (contiguous groups) or group_ids (groups in any order)")
        if num_groups is not None:
            raise ValueError(f"num_groups={num_groups} is only taken with group_ids (contiguous groups: B / G)")
        group_size = check_int("group_size", group_size, 1)
        if batch % group_size != 0:
            raise ValueError(f"rewards.shape[0]={batch} is not divisible by group_size={group_size}")
        num_groups = batch // group_size
    else:
        group_ids, num_groups = _check_group_ids(rewards, group_size, group_ids, num_groups)
    check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    check_choice("baseline", baseline, BASELINES)
    check_choice("multi_objective_aggregation", multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    eps = check_positive("eps", eps)
    std_ddof = check_int("std_ddof", std_ddof, 0)
    check_choice("singleton_groups", singleton_groups, SINGLETON_GROUPS)
    if singleton_groups == "verl" and multi_objective_aggregation == "normalize_then_sum":
        # GDPO z-scores the combined reward over the batch, not per group: no group convention applies
        raise ValueError(
            "singleton_groups='verl' applies to multi_objective_aggregation='sum_then_normalize' only, got "
            "multi_objective_aggregation='normalize_then_sum' (which z-scores over the batch); use "
            "singleton_groups='zero' with it"
        )
    return group_size, group_ids, num_groups, eps, std_ddof


def _check_group_ids(rewards: Tensor, group_size: object, group_ids: Tensor, num_groups: int | None) -> tuple:
    """``(group_ids, num_groups)`` checked: an int64 ``[B]`` tensor on ``rewards``' device, ids in range."""
    batch = rewards.shape[0]
    if group_size is not None:
        raise ValueError(f"pass group_size or group_ids, not both (got group_size={group_size!r} and group_ids)")
    check_tensor("group_ids", group_ids)
    if group_ids.dtype != torch.int64:
        raise ValueError(f"group_ids must be an int64 tensor, got {group_ids.dtype}")
    if tuple(group_ids.shape) != (batch,):
        raise ValueError(f"group_ids must have shape [B]=({batch},) (one group per row), got {tuple(group_ids.shape)}")
    if group_ids.device != rewards.device:
        raise ValueError(f"group_ids is on device {group_ids.device} but rewards is on device {rewards.device}")
    derive = num_groups is None
    if derive and batch and shapes_only(group_ids):  # a shape-only trace: there are no ids to count
        raise ValueError("num_groups is required with group_ids on the meta device or fake (its default, "
                         "max(group_ids) + 1, reads the ids): pass num_groups")  # fmt: skip
    if not derive:
        num_groups = check_int("num_groups", num_groups, 0)
    # reading the values syncs a CUDA tensor's host; a fake one has none
    if batch and (derive or group_ids.device.type == "cpu") and not shapes_only(group_ids):
        low, high = int(group_ids.min()), int(group_ids.max())
        if low < 0:
            raise ValueError(f"group_ids must be >= 0, got {low}")
        if derive:
            num_groups = high + 1
        elif high >= num_groups:
            raise ValueError(f"group_ids must be < num_groups={num_groups}, got {high}")
    return group_ids, 0 if num_groups is None else num_groups


def validate_process_advantages_args(
    step_rewards: Tensor, step_end: Tensor, group_size: int, seq_len: int, eps: float, std_ddof: int
) -> tuple[int, int, float, int]:
    """Checks process_advantages' arguments (shared with the native op's wrapper); returns the normalized numbers.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    check_tensor("step_rewards", step_rewards)
    check_tensor("step_end", step_end)
    check_floating("step_rewards", step_rewards)
    check_integer("step_end", step_end)
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must have shape [B,S], got {tuple(step_rewards.shape)}")
    check_shape("step_end", step_end, [tuple(step_rewards.shape)], f"[B,S]={tuple(step_rewards.shape)}")
    check_same_device("step_rewards", step_rewards, step_end=step_end)
    group_size = check_int("group_size", group_size, 1)
    seq_len = check_int("seq_len", seq_len, 1)
    eps = check_positive("eps", eps)
    std_ddof = check_int("std_ddof", std_ddof, 0)
    batch = step_rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(f"step_rewards.shape[0]={batch} is not divisible by group_size={group_size}")
    return group_size, seq_len, eps, std_ddof
