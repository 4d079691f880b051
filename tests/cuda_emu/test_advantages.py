"""group_advantages_kernel and process_advantages_kernel on the emulated device, driven by their launchers: every
mode, 1 to 1024 groups (one warp per group, so more than 32 groups wrap the warp loop), groups wider than a warp,
NaN (unscored) rewards, every float dtype, strided rewards. The cases are the CUDA tests'
(tests/test_group_advantages.py, tests/test_process_advantages.py) and more."""

from __future__ import annotations

import itertools

import pytest
import torch

from test_group_advantages import MODES, ragged_groups, random_rewards
from test_process_advantages import random_steps

from .checks import VALUES, check_op

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (groups, group size, K rewards, std ddof): one group of one; small; the CUDA test's; 33 groups (warp 0 takes
# groups 0 and 32); groups of 40 (a warp loops over its members).
SHAPES = [(1, 1, 1, 1), (3, 4, 2, 1), (24, 16, 3, 1), (33, 3, 1, 0), (5, 40, 1, 1)]


def group_args(rewards: torch.Tensor, group_size: int, mode: tuple, ddof: int = 1, weights=None, group_ids=None,
               num_groups: int = 0, singleton_groups: str = "zero") -> tuple:  # fmt: skip
    scale, baseline, aggregation = mode
    return (rewards, weights, group_size, scale, baseline, aggregation, 1e-4, ddof, singleton_groups, group_ids,
            num_groups)  # fmt: skip


@pytest.mark.parametrize("mode", MODES, ids="-".join)
@pytest.mark.parametrize(("groups", "group_size", "k", "ddof"), SHAPES)
def test_group_advantages(emu, mode, groups, group_size, k, ddof):
    case = MODES.index(mode) * len(SHAPES) + SHAPES.index((groups, group_size, k, ddof))
    dtype = DTYPES[case % len(DTYPES)]
    rewards = random_rewards(groups * group_size, k, seed=case).to(dtype)
    weights = torch.tensor([1.0, 0.5, -2.0][:k], dtype=dtype) if k > 1 else None
    if k == 1 and case % 2:
        rewards = rewards[:, 0]  # [B] rather than [B, 1]
    check_op(emu, "group_advantages", *group_args(rewards, group_size, mode, ddof, weights))


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_advantages_1024_groups(emu, scale):
    rewards = random_rewards(1024 * 16, 1, seed=3)[:, 0].float()  # 1024 threads: each warp takes 32 groups
    check_op(emu, "group_advantages", *group_args(rewards, 16, (scale, "mean", "sum_then_normalize")))


def test_group_advantages_strided_rewards_and_zero_std(emu):
    wide = random_rewards(40, 6, seed=9)
    wide[:8] = 1.0  # zero-std groups
    for rewards in (wide[:, ::2], wide.t().contiguous().t()[:, 1:4]):  # column stride 2; row stride 1
        assert not rewards.is_contiguous()
        for mode in [("group", "leave_one_out", "sum_then_normalize"), ("batch", "mean", "normalize_then_sum")]:
            check_op(emu, "group_advantages", *group_args(rewards, 8, mode, weights=torch.tensor([0.5, 1.0, 2.0])))


@pytest.mark.parametrize("mode", MODES, ids="-".join)
def test_group_advantages_group_ids(emu, mode):
    """Groups in any order and of any sizes (phase 0's counting sort): an empty group, singletons, groups wider than
    a warp; the CPU kernel lists the rows otherwise, and every schedule must give the same bits."""
    ids, num_groups = ragged_groups(seed=MODES.index(mode))
    k = 2 if mode[2] == "normalize_then_sum" else 1
    rewards = random_rewards(len(ids), k, seed=4).float()
    singletons = "verl" if mode[2] == "sum_then_normalize" else "zero"
    check_op(emu, "group_advantages", *group_args(rewards, 0, mode, group_ids=ids, num_groups=num_groups,
                                                  singleton_groups=singletons))  # fmt: skip
    many = (torch.arange(3000) % 1100)[torch.randperm(3000, generator=torch.Generator().manual_seed(1))]
    check_op(emu, "group_advantages", *group_args(random_rewards(3000, 1, seed=5)[:, 0].double(), 0, mode,
                                                  group_ids=many, num_groups=1100))  # fmt: skip


PROCESS_SHAPES = [(4, 5, 23, 1), (1, 3, 7, 1), (8, 1, 64, 0), (64, 5, 9, 1)]  # the last: more cells than threads


@pytest.mark.parametrize(("group_size", "steps", "seq_len", "ddof"), PROCESS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_process_advantages(emu, group_size, steps, seq_len, ddof, dtype):
    rewards, ends = random_steps(group_size * 6, steps, seq_len, seed=steps)
    if dtype == torch.bfloat16:
        ends = ends.int()
    check_op(emu, "process_advantages", rewards.to(dtype), ends, group_size, seq_len, 1e-4, ddof, tol=VALUES)


def test_process_advantages_strided(emu):
    rewards, ends = random_steps(12, 4, 10, seed=2)
    wide_rewards = torch.stack([rewards, rewards], dim=2).reshape(12, 8)[:, ::2]
    wide_ends = torch.cat([ends, ends], dim=1)[:, :4]
    assert not wide_rewards.is_contiguous() and not wide_ends.is_contiguous()
    for group_size, eps in itertools.product((3, 4), (1e-4, 0.5)):
        check_op(emu, "process_advantages", wide_rewards, wide_ends, group_size, 10, eps, 1)
