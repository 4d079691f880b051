"""grpo_ext.group_advantages against the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference
from grpo_ext.validation.options import BASELINES, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS

MODES = list(itertools.product(SCALE_REWARDS, BASELINES, MULTI_OBJECTIVE_AGGREGATIONS))


def random_rewards(batch: int, k: int, *, seed: int, nan_fraction: float = 0.15, ties: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, k, generator=g, dtype=torch.float64)
    if ties:  # binary rewards make equal-reward (zero-std) groups common
        r[: batch // 2] = (r[: batch // 2] > 0).double()
    r[torch.rand(batch, k, generator=g) < nan_fraction] = float("nan")
    return r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation"), MODES)
@pytest.mark.parametrize(("group_size", "k", "ddof"), [(4, 1, 1), (16, 3, 1), (1, 2, 1), (5, 2, 0), (40, 1, 1)])
def test_matches_reference(device, scale, baseline, aggregation, group_size, k, ddof):
    rewards = random_rewards(group_size * 24, k, seed=group_size * 10 + k)
    if k == 1:
        rewards = rewards[:, 0]
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation, std_ddof=ddof)
    if k > 1:
        kwargs["reward_weights"] = [1.0, 0.5, -2.0][:k]
    expected = reference.group_advantages(rewards, group_size, **kwargs)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        got = grpo_ext.group_advantages(rewards.to(device, dtype), group_size, **kwargs)
        assert got.advantages.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.isfinite(got.advantages).all()
        assert_close(got.advantages, expected.advantages, rtol=tol, atol=tol)
        assert_close(got.group_mean, expected.group_mean, rtol=tol, atol=tol)
        assert_close(got.group_std, expected.group_std, rtol=tol, atol=tol)
        assert torch.equal(got.zero_std.cpu(), expected.zero_std)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_std_and_singletons(device):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 2.0, float("nan"), float("nan"), float("nan")])
    out = grpo_ext.group_advantages(rewards.to(device), 4)
    assert out.zero_std.tolist() == [True, False, False]  # the third group has a single scored member
    assert out.advantages[:4].abs().max().item() == 0
    single = grpo_ext.group_advantages(torch.tensor([0.3, 0.7, 0.1], device=device), 1)
    assert not single.zero_std.any(), "a singleton group is never zero_std"
    assert single.advantages.abs().max().item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline"), list(itertools.product(SCALE_REWARDS, BASELINES)))
def test_verl_singleton_groups(device, scale, baseline):
    """singleton_groups="verl": verl's mean 0 and std 1 for a group of one row (compute_grpo_outcome_advantage);
    sum_then_normalize only (normalize_then_sum refuses it: test_verl_singleton_groups_with_normalize_then_sum_...)."""
    rewards = torch.tensor([0.3, -0.7, float("nan"), 2.0, 0.0], dtype=torch.float64)
    kwargs = dict(scale_rewards=scale, baseline=baseline, eps=1e-6)
    expected = reference.group_advantages(rewards, 1, singleton_groups="verl", **kwargs)
    got = grpo_ext.group_advantages(rewards.to(device), 1, singleton_groups="verl", **kwargs)
    assert_close(got.advantages, expected.advantages, rtol=1e-12, atol=1e-12)
    zero = reference.group_advantages(rewards, 1, **kwargs).advantages
    # verl: A = r / (1 + eps) (std 1), r unscaled, an unscored row 0; grpo_ext's default: 0
    sigma = {"group": 1.0, "none": 0.0, "batch": torch.std(rewards[~rewards.isnan()]).item()}[scale]
    want = torch.nan_to_num(rewards) / (sigma + 1e-6 if scale != "none" else 1.0)
    assert_close(expected.advantages, want, rtol=1e-12, atol=1e-12)
    assert zero.abs().max() == 0
    for size in (2, 4):  # larger groups: the option changes nothing
        wide = torch.randn(8, dtype=torch.float64)
        assert torch.equal(grpo_ext.group_advantages(wide, size, singleton_groups="verl", **kwargs).advantages,
                           grpo_ext.group_advantages(wide, size, **kwargs).advantages)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_rewards(device):
    rewards = random_rewards(64, 1, seed=1, nan_fraction=0.0)[:, 0]
    for dtype in (torch.bfloat16, torch.float16):
        low = rewards.to(dtype)
        expected = reference.group_advantages(low.double(), 8)
        got = grpo_ext.group_advantages(low.to(device), 8)
        assert got.advantages.dtype == torch.float32
        assert_close(got.advantages, expected.advantages, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deterministic_and_large(device, dtype):
    # 1024 groups: the CUDA kernel's largest block (1024 threads); float64 there once needed more registers than
    # an SM has for that block (a launch failure, now prevented by __launch_bounds__).
    rewards = random_rewards(1024 * 16, 1, seed=3)[:, 0].to(device, dtype)
    runs = [grpo_ext.group_advantages(rewards, 16, scale_rewards="batch") for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.advantages, runs[0].advantages)
    expected = reference.group_advantages(rewards.double().cpu(), 16, scale_rewards="batch")
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    assert_close(runs[0].advantages, expected.advantages, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------- process_advantages


@pytest.mark.parametrize("device", DEVICES)
def test_normalize_then_sum_leaves_unscorable_rows_out_of_the_batch_statistics(device):
    """GDPO: a row whose rewards are all NaN has R = NaN (not 0): it is not in the batch mean and std, and gets A = 0.
    A group with no scored member reports group_mean = group_std = 0 (docs/math.md section 1)."""
    nan = float("nan")
    rewards = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [nan, nan], [1.0, 1.0],  # a group with an unscorable row
         [2.0, nan], [0.0, 3.0], [1.0, 2.0], [nan, 1.0],
         [nan, nan], [nan, nan], [nan, nan], [nan, nan]],  # a group with no scored member
        dtype=torch.float64,
    )  # fmt: skip
    weights, eps = torch.tensor([1.0, 0.5], dtype=torch.float64), 1e-4
    # The contract written out: z-score each column in its group, weighted nansum, unscorable rows NaN, then the
    # z-score of R over its scored rows.
    by_group = rewards.reshape(3, 4, 2)
    counts = (~by_group.isnan()).sum(1, keepdim=True)
    mean = by_group.nansum(1, keepdim=True) / counts.clamp(min=1)
    std = (((by_group - mean) ** 2).nansum(1, keepdim=True) / (counts - 1).clamp(min=1)).sqrt() * (counts > 1)
    combined = ((by_group - mean) / (std + eps) * weights).nansum(2).reshape(12)
    combined[rewards.isnan().all(1)] = nan
    scored = combined[~combined.isnan()]
    expected = ((combined - scored.mean()) / (scored.std() + eps)).nan_to_num(0.0)
    for impl in (reference, grpo_ext):
        out = impl.group_advantages(rewards.to(device), 4, reward_weights=[1.0, 0.5],
                                    multi_objective_aggregation="normalize_then_sum")  # fmt: skip
        assert_close(out.advantages, expected, rtol=1e-12, atol=1e-12, msg=impl.__name__)
        assert out.advantages[2] == 0 and (out.advantages[8:] == 0).all()
        assert out.group_mean[2] == 0 and out.group_std[2] == 0 and not out.zero_std[2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation"), MODES)
def test_infinite_rewards_count_as_unscored_and_no_nan_leaves(device, scale, baseline, aggregation):
    """+-inf is not a reward: it is treated as NaN (not scored), so the advantages stay finite (docs/math.md 1)."""
    rewards = random_rewards(16, 2, seed=31)
    infinite = rewards.clone()
    infinite[3, 0], infinite[9, 1], infinite[12] = float("inf"), float("-inf"), float("inf")
    unscored = torch.where(torch.isfinite(infinite), infinite, float("nan"))
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation)
    expected = reference.group_advantages(unscored, 4, **kwargs)
    for impl in (reference, grpo_ext):
        got = impl.group_advantages(infinite.to(device), 4, **kwargs)
        assert torch.isfinite(got.advantages).all() and torch.isfinite(got.group_mean).all(), impl.__name__
        for name in ("advantages", "group_mean", "group_std"):
            assert_close(getattr(got, name), getattr(expected, name), rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(got.zero_std.cpu(), expected.zero_std)


@pytest.mark.parametrize("device", DEVICES)
def test_infinite_step_rewards_count_as_unscored(device):
    step_rewards = torch.rand(4, 3, dtype=torch.float64)
    step_end = torch.tensor([[1, 3, 5], [0, 2, -1], [4, 5, 6], [2, 6, -1]])
    infinite = step_rewards.clone()
    infinite[0, 1], infinite[2, 2] = float("inf"), float("-inf")
    unscored = torch.where(torch.isfinite(infinite), infinite, float("nan"))
    expected = reference.process_advantages(unscored, step_end, 2, 7)
    for impl in (reference, grpo_ext):
        got = impl.process_advantages(infinite.to(device), step_end.to(device), 2, 7)
        assert torch.isfinite(got).all(), impl.__name__
        assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=impl.__name__)


# ---------------------------------------------------------------------------------------------------------------
# Finite rewards near the dtype's largest values: statistics in units of a power of two (docs/math.md section 1)
# ---------------------------------------------------------------------------------------------------------------


def huge_rewards(dtype: torch.dtype) -> torch.Tensor:
    """``[20, 2]`` finite rewards, five groups of 4, whose sums, squared deviations and differences overflow ``dtype``
    (float32; float64: the rewards above 1 in magnitude 2^869 times larger); tiny and ordinary rewards among them, NaN
    (unscored)."""
    nan = float("nan")
    r = torch.tensor([[3e38, 3e38], [3e38, 3e38], [-3e38, -3e38], [-3e38, -3e38],  # issue 40's [1, 1, -1, -1]
                      [1e38, nan], [-1e38, 2e38], [5e37, 1.0], [-2e37, -3e38],
                      [3e38, 1e-30], [1e-30, 3e38], [-2e38, 3e38], [nan, nan],  # tiny rewards among huge ones
                      [0.25, 0.5], [1.0, nan], [0.0, 1.0], [1.0, 0.0],  # ordinary rewards beside huge groups
                      [-3.4e38, 3.4e38], [3.4e38, 3.4e38], [1e-38, -1e38], [0.0, 1e-20]],
                     dtype=torch.float32).double()  # fmt: skip
    return (r if dtype == torch.float32 else torch.where(r.abs() > 1, r * 2.0**869, r)).to(dtype)


def assert_close_in_dtype(got, expected, tol: float) -> None:
    """``got`` against the float64 ``expected`` rounded to ``got``'s dtype: a statistic beyond float32's range (the std
    3.5e38 of issue 40's group) is +-inf there, as docs/math.md says; never NaN."""
    for name in ("advantages", "group_mean", "group_std"):
        value = getattr(got, name)
        assert not value.isnan().any(), name
        assert_close(value, getattr(expected, name).to(value.dtype), rtol=tol, atol=tol, msg=name)
    assert torch.equal(got.zero_std.cpu(), expected.zero_std.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation"), MODES)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rewards_near_the_largest_finite_values(device, scale, baseline, aggregation, k, dtype):
    """Issue 40: +-3e38 float32 rewards gave NaN advantages (an overflowing sum, squares and difference); with K = 2
    the weighted sum R overflows too (4.5e38)."""
    rewards = huge_rewards(dtype) if k == 2 else huge_rewards(dtype)[:, 0]
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation)
    if k == 2:
        kwargs["reward_weights"] = [1.0, 0.5]
    expected = reference.group_advantages(rewards.double(), 4, **kwargs)
    got = grpo_ext.group_advantages(rewards.to(device), 4, **kwargs)
    assert_close_in_dtype(got, expected, 2e-5 if dtype == torch.float32 else 1e-12)
    if scale != "none" or aggregation == "normalize_then_sum":  # scaled advantages are finite: [1, 1, -1, -1]-ish
        assert torch.isfinite(got.advantages).all()
    if (k, dtype, scale, baseline, aggregation) == (1, torch.float32, "group", "mean", "sum_then_normalize"):
        assert_close(got.advantages[:4], torch.tensor([1.0, 1.0, -1.0, -1.0]) * 0.75**0.5, rtol=1e-6, atol=0)
    runs = [grpo_ext.group_advantages(rewards.to(device), 4, **kwargs).advantages for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], got.advantages)
    # The reference in the rewards' own dtype gives the same advantages (an outside audit, 2026-11-29: float32
    # rewards gave it an infinite std, so advantages of 0)
    assert_close(reference.group_advantages(rewards, 4, **kwargs).advantages, expected.advantages.to(dtype),
                 rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation", "singleton_groups"),
                         [(*mode, singletons) for mode in MODES for singletons in ("zero", "verl")
                          if singletons == "zero" or mode[2] == "sum_then_normalize"])  # fmt: skip
def test_rewards_near_the_largest_finite_values_with_group_ids(device, scale, baseline, aggregation, singleton_groups):
    """The same rewards in groups of 1 to 8 rows in any order, singleton groups included (verl's convention too)."""
    ids = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5])
    ids = ids[torch.randperm(20, generator=torch.Generator().manual_seed(MODES.index((scale, baseline, aggregation))))]
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation,
                  singleton_groups=singleton_groups, reward_weights=[1.0, 0.5])  # fmt: skip
    for dtype in (torch.float32, torch.float64):
        rewards = huge_rewards(dtype)
        expected = reference.group_advantages(rewards.double(), group_ids=ids, **kwargs)
        got = grpo_ext.group_advantages(rewards.to(device), group_ids=ids.to(device), **kwargs)
        assert_close_in_dtype(got, expected, 2e-5 if dtype == torch.float32 else 1e-12)


# ---------------------------------------------------------------------------------------------------------------
# group_ids: groups in any order and of any sizes (verl's uid grouping)
# ---------------------------------------------------------------------------------------------------------------


def assert_same_advantages(got, expected, tol: float) -> None:
    assert torch.isfinite(got.advantages).all()
    assert_close(got.advantages, expected.advantages, rtol=tol, atol=tol)
    assert_close(got.group_mean, expected.group_mean, rtol=tol, atol=tol)
    assert_close(got.group_std, expected.group_std, rtol=tol, atol=tol)
    assert torch.equal(got.zero_std.cpu(), expected.zero_std.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation"), MODES)
@pytest.mark.parametrize(("group_size", "k"), [(4, 1), (5, 3), (40, 1)])
def test_group_ids_match_contiguous_groups_after_a_permutation(device, scale, baseline, aggregation, group_size, k):
    """Rows shuffled, each carrying its group's id: the same advantages (moved with their rows) and group stats."""
    batch = group_size * 9
    rewards = random_rewards(batch, k, seed=group_size + k)
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation)
    if k > 1:
        kwargs["reward_weights"] = [1.0, 0.5, -2.0]
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(k))
    ids = (torch.arange(batch) // group_size)[perm]
    for impl, dev, dtype, tol in ((reference, "cpu", torch.float64, 1e-12), (grpo_ext, device, torch.float64, 1e-12),
                                  (grpo_ext, device, torch.float32, 2e-5)):  # fmt: skip
        contiguous = impl.group_advantages(rewards.to(dev, dtype), group_size, **kwargs)
        shuffled = impl.group_advantages(rewards[perm].to(dev, dtype), group_ids=ids.to(dev), **kwargs)
        moved = contiguous._replace(advantages=contiguous.advantages[perm.to(dev)])
        assert_same_advantages(shuffled, moved, tol)


def ragged_groups(seed: int) -> tuple[torch.Tensor, int]:
    """Group ids of rows in a random order: groups of 1 to 41 rows (wider than a warp), and group 3 without rows."""
    sizes = [2, 1, 7, 0, 41, 3, 1, 16, 5, 33, 2, 9]
    ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))], len(sizes)


# singleton_groups applies to sum_then_normalize only
RAGGED_CASES = [(*mode, singletons) for mode in MODES for singletons in ("zero", "verl")
                if singletons == "zero" or mode[2] == "sum_then_normalize"]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("scale", "baseline", "aggregation", "singleton_groups"), RAGGED_CASES)
def test_group_ids_of_different_sizes_match_reference(device, scale, baseline, aggregation, singleton_groups):
    ids, num_groups = ragged_groups(seed=MODES.index((scale, baseline, aggregation)))
    k = 2 if aggregation == "normalize_then_sum" else 1
    rewards = random_rewards(len(ids), k, seed=7)
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation,
                  singleton_groups=singleton_groups, num_groups=num_groups)  # fmt: skip
    expected = reference.group_advantages(rewards, group_ids=ids, **kwargs)
    assert expected.group_mean.shape == (num_groups,) and expected.group_mean[3] == 0 and not expected.zero_std[3]
    if scale == "group" and aggregation == "sum_then_normalize":  # each group alone, through the contiguous path
        for g in range(num_groups):
            rows = (ids == g).nonzero()[:, 0]
            if len(rows):
                alone = reference.group_advantages(rewards[rows], len(rows), **{**kwargs, "num_groups": None})
                assert_close(expected.advantages[rows], alone.advantages, rtol=1e-12, atol=1e-12)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        runs = [grpo_ext.group_advantages(rewards.to(device, dtype), group_ids=ids.to(device), **kwargs)
                for _ in range(2)]  # fmt: skip
        assert_same_advantages(runs[0], expected, tol)
        assert torch.equal(runs[0].advantages, runs[1].advantages)  # deterministic whatever order rows are placed in


@pytest.mark.parametrize("device", DEVICES)
def test_group_ids_default_num_groups_and_strided_ids(device):
    ids, _ = ragged_groups(seed=1)
    rewards = random_rewards(len(ids), 1, seed=2)[:, 0].to(device)
    wide = torch.stack([ids, ids], 1).to(device)[:, 0]  # a strided [B] view
    out = grpo_ext.group_advantages(rewards, group_ids=wide)  # num_groups = max + 1 = 12
    expected = reference.group_advantages(rewards.cpu(), group_ids=ids)
    assert out.group_mean.shape == (12,)
    assert_same_advantages(out, expected, 2e-5)


@pytest.mark.parametrize("impl", [grpo_ext, reference], ids=["kernel", "reference"])
def test_group_ids_bad_input_raises_naming_it(impl):
    rewards, ids = torch.rand(6), torch.tensor([0, 1, 0, 2, 1, 2])
    cases = [
        (dict(group_ids=ids.int()), r"group_ids must be an int64 tensor, got torch\.int32"),
        (dict(group_ids=ids[:5]), r"group_ids must have shape \[B\]=\(6,\)"),
        (dict(group_ids=ids.reshape(2, 3)), r"group_ids must have shape \[B\]"),
        (dict(group_ids=ids - 1), r"group_ids must be >= 0, got -1"),
        (dict(group_ids=ids, num_groups=2), r"group_ids must be < num_groups=2, got 2"),
        (dict(group_ids=ids, num_groups=-1), r"num_groups must be >= 0"),
        (dict(group_ids=[0, 1, 0, 2, 1, 2]), r"group_ids must be a torch\.Tensor"),
        (dict(), r"needs group_size .* or group_ids"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            impl.group_advantages(rewards, **kwargs)
    with pytest.raises(ValueError, match=r"pass group_size or group_ids, not both"):
        impl.group_advantages(rewards, 2, group_ids=ids)
    with pytest.raises(ValueError, match=r"num_groups=3 is only taken with group_ids"):
        impl.group_advantages(rewards, 2, num_groups=3)


def test_group_ids_raw_op_checks_them():
    op = torch.ops.grpo_ext.group_advantages
    args = (torch.rand(4), None, 0, "group", "mean", "sum_then_normalize", 1e-4, 1, "zero")
    with pytest.raises(RuntimeError, match=r"group_ids must be >= 0, got -3"):
        op(*args, torch.tensor([0, -3, 1, 1]), 2)
    with pytest.raises(RuntimeError, match=r"group_ids must be < num_groups=2, got 5"):
        op(*args, torch.tensor([0, 5, 1, 1]), 2)
    with pytest.raises(RuntimeError, match=r"group_ids must be an int64 tensor"):
        op(*args, torch.tensor([0, 1, 1, 0], dtype=torch.int32), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_group_ids_on_another_device_raise():
    with pytest.raises(ValueError, match=r"group_ids is on device cpu but rewards is on device cuda"):
        grpo_ext.group_advantages(torch.rand(4, device="cuda"), group_ids=torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("impl", [grpo_ext, reference], ids=["kernel", "reference"])
def test_meta_group_ids_need_num_groups(impl):
    """Deriving num_groups reads the ids, which a meta tensor (a shape-only trace) does not hold."""
    rewards = torch.empty(6, device="meta")
    ids = torch.empty(6, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"num_groups .*meta"):
        impl.group_advantages(rewards, group_ids=ids)


def test_meta_group_ids_with_num_groups_give_the_shapes():
    rewards = torch.empty(6, device="meta")
    out = grpo_ext.group_advantages(rewards, group_ids=torch.empty(6, dtype=torch.int64, device="meta"), num_groups=4)
    assert out.advantages.shape == (6,) and out.group_mean.shape == (4,) and out.zero_std.dtype == torch.bool


@pytest.mark.parametrize("impl", [grpo_ext, reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("grouping", [dict(group_size=1), dict(group_ids=torch.tensor([0, 1, 1, 2]))])
def test_verl_singleton_groups_with_normalize_then_sum_is_refused(impl, grouping):
    """GDPO z-scores over the batch: verl's singleton convention has no meaning there (docs/math.md section 1)."""
    with pytest.raises(ValueError, match=r"singleton_groups='verl'.*multi_objective_aggregation='normalize_then_sum'"):
        impl.group_advantages(torch.rand(4, 2, dtype=torch.float64), singleton_groups="verl",
                              multi_objective_aggregation="normalize_then_sum", **grouping)  # fmt: skip


@pytest.mark.parametrize("impl", [grpo_ext, reference], ids=["kernel", "reference"])
def test_advantages_are_constants_and_weights_are_numbers(impl):
    """Rewards that require grad give advantages that do not (no gradient reaches the rewards, in both; the kernel's
    used to require grad with no autograd formula behind it: a backward gave None and a warning); integer weight
    tensors are numbers as a list of ints is; bool weights and rewards without columns are refused, naming them."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], requires_grad=True)
    out = impl.group_advantages(rewards, 2, reward_weights=torch.tensor([2, 1]))
    assert not any(t.requires_grad for t in (out.advantages, out.group_mean, out.group_std))
    assert torch.equal(out.advantages, impl.group_advantages(rewards.detach(), 2, reward_weights=[2.0, 1.0]).advantages)
    step = impl.process_advantages(rewards, torch.tensor([[0, 1]] * 4), 2, 2)
    assert not step.requires_grad
    with pytest.raises(ValueError, match=r"reward_weights must hold real numbers, got a torch\.bool tensor"):
        impl.group_advantages(rewards, 2, reward_weights=torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"rewards has no reward column \(K == 0\)"):
        impl.group_advantages(torch.zeros(4, 0), 2)
