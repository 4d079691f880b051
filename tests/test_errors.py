"""Bad input gets a clear error naming the argument, from the Python wrappers and from the native ops alike."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import HAS_CUDA, make_loss_batch
from grpo_ext import reference
from grpo_ext.validation.options import LossOptions

IMPLEMENTATIONS = [grpo_ext, reference]


@pytest.fixture
def batch():
    return make_loss_batch(seed=0, batch=8, seq_len=5).to("cpu", torch.float32)


LOSS_CASES = [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(kl_estimator="k4", beta=0.1, ref_logps="ref"), "kl_estimator"),
    (dict(importance_sampling_level="row"), "importance_sampling_level"),
    (dict(beta=0.1), "ref_logps is required"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(epsilon=float("nan")), "epsilon"),
    (dict(epsilon_high=-0.1), "epsilon_high"),
    (dict(delta=1.0), "delta"),
    (dict(beta=-1.0, ref_logps="ref"), "beta"),
    (dict(beta=float("inf"), ref_logps="ref"), "beta must be a finite number"),
    (dict(loss_scale=float("nan")), "loss_scale must be a finite number"),
    (dict(loss_scale=float("inf")), "loss_scale must be a finite number"),
    (dict(loss_type="dapo", num_items_in_batch="meta"), "num_items_in_batch is on device meta"),
    (dict(loss_scale="meta"), "loss_scale is on device meta"),
    (dict(sample_mask="nan_float_rows"), "sample_mask holds NaN"),
    (dict(kl_clamp=0.0, beta=0.1, ref_logps="ref"), "kl_clamp"),
    (dict(max_completion_length=0), "max_completion_length"),
    (dict(num_items_in_batch=0), "num_items_in_batch"),
    (dict(old_logps="short"), "old_logps"),
    (dict(is_weights="short"), "is_weights"),
    (dict(sample_mask="short_rows"), "sample_mask"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
]

#: A flag given as a string (a YAML or command-line value) would be read as True: only a bool is taken.
FLAG_CASES = [
    (dict(skip_empty_rows="false"), "skip_empty_rows must be a bool"),
    (dict(skip_empty_rows=1), "skip_empty_rows must be a bool"),
    (dict(use_bias_correction_kl="no"), "use_bias_correction_kl must be a bool"),
    (dict(use_bias_correction_kl=None), "use_bias_correction_kl must be a bool"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize(("kwargs", "match"), FLAG_CASES)
def test_loss_flags_must_be_bools(impl, batch, kwargs, match):
    with pytest.raises(ValueError, match=match):
        impl.grpo_loss(batch.logps, batch.advantages, batch.mask, **kwargs)


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
        elif value == "meta":  # a tensor on another device than logps (the CPU kernel would read garbage)
            value = torch.tensor(5.0, device="meta")
        elif value == "nan_float_rows":
            value = torch.tensor([1.0, float("nan"), *[1.0] * (batch.logps.shape[0] - 2)])
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


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
def test_nan_in_a_float_mask_is_rejected(impl, batch):
    mask = batch.mask.float()
    mask[2, 1] = float("nan")
    with pytest.raises(ValueError, match="completion_mask holds NaN"):
        impl.grpo_loss(batch.logps, batch.advantages, mask)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize("options", [dict(loss_type="grpo", epsilon_high=0.0), dict(loss_type="cispo")])
def test_zero_clip_ranges_are_accepted_and_match(impl, batch, options):
    """epsilon = 0 (no lower clip range; Liger's and open-instruct's CISPO tests use it) and epsilon_high = 0."""
    logps = batch.logps.double().requires_grad_()
    kwargs = dict(old_logps=batch.old_logps.double(), epsilon=0.0, **options)
    out = impl.grpo_loss(logps, batch.advantages.double(), batch.mask, **kwargs)
    out.loss.backward()
    expected_logps = batch.logps.double().requires_grad_()
    expected = reference.grpo_loss(expected_logps, batch.advantages.double(), batch.mask, **kwargs)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(logps.grad, expected_logps.grad)
    assert torch.isfinite(out.loss) and logps.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "call",
    [
        lambda lg, ids, m: grpo_ext.grpo_loss(lg.logsumexp(-1) - 3.0, torch.ones(2), m),
        lambda lg, ids, m: grpo_ext.selective_log_softmax(lg, ids),
        lambda lg, ids, m: grpo_ext.grpo_loss_from_logits(lg, ids, torch.ones(2), m),
        lambda lg, ids, m: grpo_ext.grpo_loss_from_hidden(lg, torch.randn(5, 5, dtype=lg.dtype), ids, torch.ones(2), m),
    ],
    ids=["grpo_loss", "selective_log_softmax", "grpo_loss_from_logits", "grpo_loss_from_hidden"],
)
def test_double_backward_is_refused_not_silently_zero(call):
    """create_graph=True (a gradient penalty) would get a zero second derivative from the kernels: it raises."""
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))

    def scalar():
        out = call(logits, ids, torch.ones(2, 3))
        return out.loss if hasattr(out, "loss") else out.logps.sum()

    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(scalar(), logits, create_graph=True)
    (first_order,) = torch.autograd.grad(scalar(), logits)  # without create_graph: as before
    assert torch.isfinite(first_order).all() and first_order.abs().sum() > 0


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
    (dict(reward_weights=torch.ones(2, device="meta")), "reward_weights is on device meta"),
    (dict(reward_weights=[1.0, float("nan")]), "reward_weights must be finite"),
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


@pytest.mark.parametrize("op", ["grpo_loss_forward", "grpo_loss_from_logits", "grpo_loss_from_logits_"])
@pytest.mark.parametrize("which", ["completion_mask", "sample_mask"])
def test_native_ops_refuse_a_nan_mask(op, which):
    """The raw CPU ops refuse a NaN mask value as the Python functions do (issue 40: grpo_loss_from_logits returned
    NaN), with the same message."""
    from grpo_ext.validation.options import LogitOptions

    mask, sample_mask = torch.ones(2, 3), torch.ones(2)
    (mask[1, 2] if which == "completion_mask" else sample_mask[1]).fill_(float("nan"))
    option_args = LossOptions(epsilon_high=0.2, max_completion_length=3, sample_mask=sample_mask).op_args()
    with pytest.raises(RuntimeError, match=f"{which} holds NaN; a mask's values must be 0 or 1"):
        if op == "grpo_loss_forward":
            torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), mask, *option_args, False)
        else:
            logits, ids = torch.randn(2, 3, 7), torch.zeros(2, 3, dtype=torch.int64)
            getattr(torch.ops.grpo_ext, op)(logits, ids, torch.rand(2), mask, *option_args,
                                            *LogitOptions().op_args(), 0.0, None, True)  # fmt: skip


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
