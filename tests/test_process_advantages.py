"""grpo_ext.process_advantages against the float64 reference and a hand-computed example."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference


def random_steps(batch: int, steps: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, steps, generator=g, dtype=torch.float64)
    ends = torch.sort(torch.randint(0, seq_len + 3, (batch, steps), generator=g), dim=1).values
    n_valid = torch.randint(0, steps + 1, (batch,), generator=g)
    for i in range(batch):
        rewards[i, n_valid[i] :] = float("nan")
        ends[i, n_valid[i] :] = -1
    rewards[0, 0] = float("nan")  # a NaN reward with a real step end: not a valid step
    return rewards, ends


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("group_size", "steps", "seq_len", "ddof"), [(4, 5, 23, 1), (1, 3, 7, 1), (8, 1, 64, 0)])
def test_process_advantages_match_reference(device, group_size, steps, seq_len, ddof):
    rewards, ends = random_steps(group_size * 6, steps, seq_len, seed=steps)
    expected = reference.process_advantages(rewards, ends, group_size, seq_len, std_ddof=ddof)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        got = grpo_ext.process_advantages(
            rewards.to(device, dtype), ends.to(device), group_size, seq_len, std_ddof=ddof
        )
        assert got.shape == (group_size * 6, seq_len)
        assert torch.isfinite(got).all()
        assert_close(got, expected, rtol=tol, atol=tol)


def test_process_advantages_hand_example():
    # one group of two rows; steps (r=1, end=1), (r=0, end=3) and (r=2, end=0); mean 1, std 1 (ddof 1)
    rewards = torch.tensor([[1.0, 0.0], [2.0, float("nan")]])
    ends = torch.tensor([[1, 3], [0, -1]])
    got = grpo_ext.process_advantages(rewards, ends, 2, 5, eps=0.0 + 1e-12)
    expected = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_rewards_near_the_largest_finite_values(device, dtype):
    """Issue 40: finite step rewards of +-3e38 overflowed the group's sum and squares (NaN advantages in float32);
    the statistics are taken in units of a power of two. Tiny rewards among them, and an ordinary group beside;
    float64 at 2^869 times the same values."""
    nan = float("nan")
    rewards = torch.tensor([[3e38, -3e38, nan], [3e38, -3e38, 1e-30], [-3.4e38, 1e38, 2e38], [3.4e38, nan, nan],
                            [0.5, 1.0, nan], [0.0, 2.0, 1.0], [1.0, nan, nan], [0.25, 0.75, 0.5]],
                           dtype=torch.float32).double()  # fmt: skip
    ends = torch.tensor([[1, 3, -1], [0, 2, 4], [1, 2, 5], [3, -1, -1], [2, 4, -1], [0, 1, 2], [5, -1, -1], [1, 3, 4]])
    if dtype == torch.float64:
        rewards = rewards * 2.0**869
    expected = reference.process_advantages(rewards, ends, 4, 6)
    got = grpo_ext.process_advantages(rewards.to(device, dtype), ends.to(device), 4, 6)
    assert torch.isfinite(got).all()
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    assert_close(got, expected, rtol=tol, atol=tol)
