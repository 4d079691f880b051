"""Bad input gets a clear error naming the argument, from the Python wrappers and from the native ops alike."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import HAS_CUDA, make_loss_batch
from grpo_ext import reference
from grpo_ext.ops.options import LossOptions

IMPLEMENTATIONS = [grpo_ext, reference]


@pytest.fixture
def batch():
    return make_loss_batch(seed=0, batch=8, seq_len=5).to("cpu", torch.float32)


LOSS_CASES = [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(kl_estimator="k4", beta=0.1, ref_logps="ref"), "kl_estimator"),
    (dict(importance_sampling_level="row"), "importance_sampling_level"),
    (dict(beta=0.1), "ref_logps is required"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(epsilon_high=0.0), "epsilon_high"),
    (dict(delta=1.0), "delta"),
    (dict(beta=-1.0, ref_logps="ref"), "beta"),
    (dict(kl_clamp=0.0, beta=0.1, ref_logps="ref"), "kl_clamp"),
    (dict(max_completion_length=0), "max_completion_length"),
    (dict(num_items_in_batch=0), "num_items_in_batch"),
    (dict(old_logps="short"), "old_logps"),
    (dict(is_weights="short"), "is_weights"),
    (dict(sample_mask="short_rows"), "sample_mask"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize(("kwargs", "match"), LOSS_CASES)
def test_loss_argument_errors(impl, batch, kwargs, match):
    resolved = {}
    for key, value in kwargs.items():
        if value == "ref":
            value = batch.ref_logps
        elif value == "short":
            value = batch.logps[:, :3]
        elif value == "short_rows":
            value = batch.sample_mask[:3]
        resolved[key] = value
    with pytest.raises(ValueError, match=match):
        impl.grpo_loss(batch.logps, batch.advantages, batch.mask, **resolved)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
def test_loss_tensor_errors(impl, batch):
    with pytest.raises(ValueError, match="logps must be a floating-point tensor"):
        impl.grpo_loss(batch.logps.long(), batch.advantages, batch.mask)
    with pytest.raises(ValueError, match="logps must have shape"):
        impl.grpo_loss(batch.logps[0], batch.advantages, batch.mask)
    with pytest.raises(ValueError, match="advantages must have shape"):
        impl.grpo_loss(batch.logps, batch.advantages[:5], batch.mask)
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        impl.grpo_loss(batch.logps, batch.advantages, batch.mask[:, :2])
    with pytest.raises(ValueError, match="empty batch"):
        impl.grpo_loss(batch.logps[:0], batch.advantages[:0], batch.mask[:0])


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_mixed_devices(batch):
    with pytest.raises(ValueError, match="old_logps is on device"):
        grpo_ext.grpo_loss(batch.logps.cuda(), batch.advantages.cuda(), batch.mask.cuda(), old_logps=batch.old_logps)


ADVANTAGE_CASES = [
    (dict(group_size=0), "group_size"),
    (dict(group_size=3), "not divisible by group_size"),
    (dict(scale_rewards="std"), "scale_rewards"),
    (dict(baseline="median"), "baseline"),
    (dict(multi_objective_aggregation="max"), "multi_objective_aggregation"),
    (dict(reward_weights=[1.0, 2.0, 3.0]), "reward_weights"),
    (dict(std_ddof=-1), "std_ddof"),
    (dict(eps=0.0), "eps"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize(("kwargs", "match"), ADVANTAGE_CASES)
def test_advantage_argument_errors(impl, kwargs, match):
    kwargs = {"group_size": 4, **kwargs}
    group_size = kwargs.pop("group_size")
    with pytest.raises(ValueError, match=match):
        impl.group_advantages(torch.rand(8, 2), group_size, **kwargs)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
def test_advantage_tensor_errors(impl):
    with pytest.raises(ValueError, match="rewards must be a floating-point tensor"):
        impl.group_advantages(torch.ones(8, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="rewards must have shape"):
        impl.group_advantages(torch.rand(8, 2, 2), 4)
    with pytest.raises(ValueError, match="step_end"):
        impl.process_advantages(torch.rand(4, 2), torch.zeros(4, 3, dtype=torch.long), 2, 5)
    with pytest.raises(ValueError, match="step_end must be an integer"):
        impl.process_advantages(torch.rand(4, 2), torch.zeros(4, 2), 2, 5)


def test_native_ops_check_their_inputs():
    """The raw torch.ops check too (TORCH_CHECK), for callers that skip the Python wrappers."""
    with pytest.raises(RuntimeError, match="group_size must be >= 1"):
        torch.ops.grpo_ext.group_advantages(torch.rand(8), None, 0, "group", "mean", "sum_then_normalize", 1e-4, 1)
    with pytest.raises(RuntimeError, match="loss_type must be one of"):
        options = LossOptions(loss_type="ppo", epsilon_high=0.2, max_completion_length=3).op_args()
        torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), torch.ones(2, 3), *options, False)
    with pytest.raises(RuntimeError, match="completion_mask must have shape"):
        options = LossOptions(epsilon_high=0.2, max_completion_length=3).op_args()
        torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), torch.ones(2, 4), *options, False)
