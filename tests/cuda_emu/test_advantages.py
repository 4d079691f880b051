"""group_advantages_kernel and process_advantages_kernel on the emulated device, driven by their launchers: every
mode, 1 to 1024 groups (one warp per group, so more than 32 groups wrap the warp loop), groups wider than a warp,
NaN (unscored) rewards, every float dtype, strided rewards. The cases are the CUDA tests'
(tests/test_group_advantages.py, tests/test_process_advantages.py) and more."""

from __future__ import annotations

import itertools

import pytest
import torch

from test_group_advantages import MODES, huge_rewards, ragged_groups, random_rewards
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


@pytest.mark.parametrize("mode", MODES, ids="-".join)
def test_group_advantages_near_the_largest_finite_values(emu, mode):
    """Issue 40: finite rewards whose sums, squares and differences overflow (+-3e38 in float32, 2^869 times that in
    float64), tiny and ordinary ones among them; the weighted sum R overflowing (K = 2); groups of 40 (a team loops
    over its members); group_ids with singletons; several tiles whose groups' units differ (batch statistics). A
    std beyond float32's range is +inf there (check_op rounds the float64 oracle to the output's dtype)."""
    singletons = "verl" if mode[2] == "sum_then_normalize" else "zero"
    for dtype in (torch.float32, torch.float64):
        rewards = huge_rewards(dtype)
        weights = torch.tensor([1.0, 0.5], dtype=dtype)
        check_op(emu, "group_advantages", *group_args(rewards[:, 0], 4, mode))
        check_op(emu, "group_advantages", *group_args(rewards, 4, mode, weights=weights))
        ids = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5])
        ids = ids[torch.randperm(20, generator=torch.Generator().manual_seed(MODES.index(mode)))]
        check_op(emu, "group_advantages", *group_args(rewards, 0, mode, weights=weights, group_ids=ids, num_groups=6,
                                                      singleton_groups=singletons))  # fmt: skip
        wide = random_rewards(80, 2, seed=2, ties=False) * (5e37 if dtype == torch.float32 else 2.0**1020)
        check_op(emu, "group_advantages", *group_args(wide.to(dtype), 40, mode, weights=weights))
    many = random_rewards(300 * 8, 1, seed=6)[:, 0].float()
    many[5 * 8 : 6 * 8] *= 3e38  # huge groups in the first and a later tile, ordinary ones elsewhere
    many[200 * 8 : 201 * 8] = torch.tensor([3e38, -3e38, 1e-30, 0.0, 1e38, -1e38, float("nan"), 2e38])
    _, _, tiles, _ = launch_plan(emu, len(many), 300, 8, mode, False)
    assert tiles > 1
    check_op(emu, "group_advantages", *group_args(many, 8, mode))


PROCESS_SHAPES = [(4, 5, 23, 1), (1, 3, 7, 1), (8, 1, 64, 0), (64, 5, 9, 1)]  # the last: more cells than threads


@pytest.mark.parametrize(("group_size", "steps", "seq_len", "ddof"), PROCESS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_process_advantages(emu, group_size, steps, seq_len, ddof, dtype):
    rewards, ends = random_steps(group_size * 6, steps, seq_len, seed=steps)
    if dtype == torch.bfloat16:
        ends = ends.int()
    check_op(emu, "process_advantages", rewards.to(dtype), ends, group_size, seq_len, 1e-4, ddof, tol=VALUES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_process_advantages_near_the_largest_finite_values(emu, dtype):
    """Issue 40: step rewards whose group sums and squares overflow (+-3e38 in float32, 2^869 times that in float64),
    tiny and ordinary ones among them; 64 rows of 5 steps: more cells than a block has threads."""
    rewards, ends = random_steps(64 * 6, 5, 9, seed=8)
    rewards[:64] *= 5e37 if dtype == torch.float32 else 2.0**996  # up to 4 sigma: 2e38, 2^998
    rewards[64:72, 0] = torch.tensor([3e38, -3e38, 1e-30, 2e38, -1e38, 0.0, 3.4e38, 1e-38])
    check_op(emu, "process_advantages", rewards.to(dtype), ends, 64, 9, 1e-4, 1)


def test_process_advantages_strided(emu):
    rewards, ends = random_steps(12, 4, 10, seed=2)
    wide_rewards = torch.stack([rewards, rewards], dim=2).reshape(12, 8)[:, ::2]
    wide_ends = torch.cat([ends, ends], dim=1)[:, :4]
    assert not wide_rewards.is_contiguous() and not wide_ends.is_contiguous()
    for group_size, eps in itertools.product((3, 4), (1e-4, 0.5)):
        check_op(emu, "process_advantages", wide_rewards, wide_ends, group_size, 10, eps, 1)


def launch_plan(emu, batch: int, num_groups: int, group_size: int, mode: tuple, indexed: bool) -> tuple[int, ...]:
    """(threads per block, lanes per group, tiles = blocks of the grid, workspace bytes) the launcher chooses."""
    scale, _, aggregation = mode
    plan = emu.call("group_advantages_launch_plan", batch, num_groups, group_size, scale, aggregation, int(indexed))
    return tuple(int(v) for v in plan)


# (groups, group size): teams of 32, 8, 2 and 1 lanes per group, each grid several tiles (blocks) of groups.
MANY_TILES = [(40, 64), (300, 8), (700, 2), (600, 1)]


# Every mode at the wider groups; the mean baseline (the leave-one-out one is the same code) at the narrow ones.
TILE_CASES = [(mode, shape) for shape in MANY_TILES for mode in MODES if shape[1] > 2 or mode[1] == "mean"]


@pytest.mark.parametrize(("mode", "shape"), TILE_CASES, ids=lambda v: "-".join(map(str, v)))
def test_group_advantages_across_tiles(emu, mode, shape):
    """Grids of several blocks: the batch statistics (batch scale, GDPO) merged over the tiles, under grid caps of
    1, 2 and 3 blocks (every schedule must give the same bits), groups narrower and wider than their team."""
    groups, group_size = shape
    _, _, tiles, _ = launch_plan(emu, groups * group_size, groups, group_size, mode, False)
    assert tiles > 1
    case = MODES.index(mode) * len(MANY_TILES) + MANY_TILES.index((groups, group_size))
    k = 2 if mode[2] == "normalize_then_sum" else 1
    rewards = random_rewards(groups * group_size, k, seed=case)
    weights = torch.tensor([1.0, -0.5]) if k == 2 else None
    dtype = torch.float64 if case % 3 == 0 else torch.float32
    check_op(emu, "group_advantages", *group_args(rewards.to(dtype), group_size, mode, 1, weights))


@pytest.mark.parametrize("mode", MODES, ids="-".join)
def test_group_advantages_shuffled_group_ids_across_tiles(emu, mode):
    """group_ids in a random order over several tiles: groups of 0 to 40 rows (mean 7: teams of 8 lanes, so the
    wide groups loop), every row's group listed by the count, place and sort passes."""
    g = torch.Generator().manual_seed(MODES.index(mode))
    sizes = torch.randint(0, 13, (260,), generator=g)
    sizes[::37] = 40
    ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    ids = ids[torch.randperm(len(ids), generator=g)]
    _, width, tiles, _ = launch_plan(emu, len(ids), len(sizes), 1, mode, True)
    assert width == 8 and tiles > 1
    k = 2 if mode[2] == "normalize_then_sum" else 1
    rewards = random_rewards(len(ids), k, seed=11)
    singletons = "verl" if mode[2] == "sum_then_normalize" and mode[1] == "mean" else "zero"
    check_op(emu, "group_advantages", *group_args(rewards.float(), 0, mode, 1, group_ids=ids, num_groups=len(sizes),
                                                  singleton_groups=singletons))  # fmt: skip


def test_group_ids_offsets_scanned_over_several_batches(emu):
    """More groups than the count kernel's last block scans in one batch (kScanBatch x 1024 = 16384), empty groups
    among them: each batch starts from the rows of the batches before it (the carry), and each thread's run from the
    runs before it in its batch."""
    g = torch.Generator().manual_seed(9)
    num_groups = 16 * 1024 + 900
    sizes = torch.randint(0, 3, (num_groups,), generator=g)
    ids = torch.repeat_interleave(torch.arange(num_groups), sizes)
    ids = ids[torch.randperm(len(ids), generator=g)]
    rewards = random_rewards(len(ids), 1, seed=9)[:, 0].float()
    check_op(emu, "group_advantages", *group_args(rewards, 0, MODES[0], group_ids=ids, num_groups=num_groups))


# The H100 benchmark's shapes (benchmarks/bench_group_advantages.py): prompts x G.
BENCH_SHAPES = [(8, 8), (64, 16), (1024, 16), (4096, 16), (8192, 64), (65536, 8)]


def test_group_advantages_grid_grows_with_the_groups(emu):
    """One block per tile of groups: the grid grows with the number of groups, a team of lanes per group."""
    for prompts, group_size in BENCH_SHAPES:
        for indexed in (False, True):
            threads, width, tiles, _ = launch_plan(emu, prompts * group_size, prompts, group_size,
                                                   ("batch", "mean", "sum_then_normalize"), indexed)  # fmt: skip
            assert width == min(32, group_size), (prompts, group_size)
            assert tiles == -(-prompts // (threads // width)), (prompts, group_size)
    assert launch_plan(emu, 65536 * 8, 65536, 8, MODES[0], False)[2] == 65536 // 32  # 2048 blocks of 32 groups


@pytest.mark.parametrize("indexed", [False, True])
def test_group_advantages_launches(emu, indexed):
    """The fixed number of launches of each mode (group_advantages.cuh): 1 kernel with the group std, 2 with batch
    statistics; 2 more with group_ids."""
    ids = torch.arange(64 * 4) % 64 if indexed else None
    modes = [("group", "sum_then_normalize", 1), ("none", "sum_then_normalize", 1),
             ("batch", "sum_then_normalize", 2), ("group", "normalize_then_sum", 2)]  # fmt: skip
    for scale, aggregation, kernels in modes:
        before = dict(emu.launches)
        k = 2 if aggregation == "normalize_then_sum" else 1
        emu.call("group_advantages", *group_args(random_rewards(256, k, seed=1).float(), 0 if indexed else 4,
                                                 (scale, "mean", aggregation), group_ids=ids,
                                                 num_groups=64 if indexed else 0))  # fmt: skip
        launched = {s.split("(", 1)[0]: n - before.get(s, 0) for s, n in emu.launches.items() if n != before.get(s, 0)}
        assert sum(launched.values()) == kernels + 2 * indexed, launched
        assert all(n == 1 for n in launched.values()), launched
