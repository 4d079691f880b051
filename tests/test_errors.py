"""Bad input gets a clear error naming the argument, from the Python wrappers and from the native ops alike."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import HAS_CUDA, make_loss_batch
from grpo_ext import reference
from grpo_ext.validation.options import LogitOptions, LossOptions

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
    # a number given as a CPU tensor is checked as the number is (a device tensor's value is not read: a host sync)
    (dict(loss_scale="nan_scalar"), "loss_scale must be a finite number"),
    (dict(loss_scale="bool_scalar"), "loss_scale must be a floating or integer tensor"),
    (dict(loss_scale="vector"), "loss_scale must be a Python number or a 0-dim tensor"),
    (dict(loss_type="dapo", num_items_in_batch="zero_scalar"), "num_items_in_batch must be > 0"),
    (dict(loss_type="dapo", num_items_in_batch="bool_scalar"), "num_items_in_batch must be a floating or integer"),
    (dict(sample_mask="nan_float_rows"), "sample_mask holds nan"),
    (dict(kl_clamp=0.0, beta=0.1, ref_logps="ref"), "kl_clamp"),
    (dict(max_completion_length=0), "max_completion_length"),
    (dict(max_completion_length=torch.tensor(5, device="meta")), "max_completion_length must be a Python int or a CPU"),
    (dict(num_items_in_batch=0), "num_items_in_batch"),
    (dict(old_logps="short"), "old_logps"),
    (dict(is_weights="short"), "is_weights"),
    (dict(sample_mask="short_rows"), "sample_mask"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
]

#: Numbers given as bad tensors, by their name in LOSS_CASES.
SCALAR_TENSORS = {"nan_scalar": torch.tensor(float("nan")), "zero_scalar": torch.tensor(0.0),
                  "bool_scalar": torch.tensor(True), "vector": torch.ones(2)}  # fmt: skip

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
        elif value in SCALAR_TENSORS:
            value = SCALAR_TENSORS[value]
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
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_value_in_a_float_mask_is_rejected(impl, batch, value):
    mask = batch.mask.float()
    mask[2, 1] = value
    with pytest.raises(ValueError, match=f"completion_mask holds {value}; a mask's values must be finite"):
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


FORWARD_MODE_CALLS = {
    "grpo_loss": lambda impl, x, ids, m: impl.grpo_loss(x.logsumexp(-1) - 3.0, torch.ones(2), m).loss,
    "selective_log_softmax": lambda impl, x, ids, m: impl.selective_log_softmax(x, ids).logps.sum(),
    "grpo_loss_from_logits": lambda impl, x, ids, m: impl.grpo_loss_from_logits(x, ids, torch.ones(2), m).loss,
    "grpo_loss_from_hidden": lambda impl, x, ids, m: impl.grpo_loss_from_hidden(
        x, torch.eye(5, dtype=x.dtype), ids, torch.ones(2), m).loss,
}  # fmt: skip


def dual_tangent(function, x: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor | None:
    """``function``'s output tangent under torch.autograd.forward_ad."""
    with torch.autograd.forward_ad.dual_level():
        return torch.autograd.forward_ad.unpack_dual(function(torch.autograd.forward_ad.make_dual(x, tangent))).tangent


@pytest.mark.parametrize("op", list(FORWARD_MODE_CALLS))
@pytest.mark.parametrize("mode", ["jvp", "jacfwd", "forward_ad"])
def test_forward_mode_is_refused_not_silently_zero(op, mode):
    """torch.func.jvp, jacfwd and torch.autograd.forward_ad over a kernel op: it raises naming the op and the ways
    out (an outside check, 2026-11-29: the tangent was dropped, a zero jvp and a zero jacfwd given silently); the
    reference's forward-mode derivative is the gradient's dot product with the tangent; a call without a tangent
    is unaffected."""
    gen = torch.Generator().manual_seed(4)
    logits, tangent = torch.randn(2, 3, 5, generator=gen).double(), torch.randn(2, 3, 5, generator=gen).double()
    ids, mask = torch.randint(0, 5, (2, 3), generator=gen), torch.ones(2, 3)
    call = FORWARD_MODE_CALLS[op]
    runs = {
        "jvp": lambda f: torch.func.jvp(f, (logits,), (tangent,))[1],
        "jacfwd": lambda f: (torch.func.jacfwd(f)(logits) * tangent).sum(),
        "forward_ad": lambda f: dual_tangent(f, logits, tangent),
    }
    with pytest.raises(RuntimeError, match=rf"grpo_ext\.{op} does not support forward-mode AD .* "
                                           rf"grpo_ext\.reference\.{op}, which supports both"):  # fmt: skip
        runs[mode](lambda x: call(grpo_ext, x, ids, mask))
    want = (torch.func.grad(lambda x: call(reference, x, ids, mask))(logits) * tangent).sum()
    torch.testing.assert_close(runs[mode](lambda x: call(reference, x, ids, mask)), want)
    leaf = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(call(grpo_ext, leaf, ids, mask), leaf)  # reverse mode, as before
    torch.testing.assert_close(grad, torch.func.grad(lambda x: call(reference, x, ids, mask))(logits))


def test_counts_given_as_cpu_tensors_are_read():
    rewards = torch.rand(8, 2, dtype=torch.float64)
    torch.testing.assert_close(
        grpo_ext.group_advantages(rewards, torch.tensor(4)), reference.group_advantages(rewards, 4)
    )


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_counts_on_a_cuda_device_are_refused_not_synchronized():
    rewards = torch.rand(8, 2, device="cuda")
    with pytest.raises(ValueError, match="group_size must be a Python int or a CPU tensor, got a tensor on cuda"):
        grpo_ext.group_advantages(rewards, torch.tensor(4, device="cuda"))


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
    # a CPU tensor's values are read as a list's are (an outside audit, 2026-11-28: every advantage came out 0)
    (dict(reward_weights=torch.tensor([1.0, float("inf")])), "reward_weights must be finite"),
    (dict(reward_weights=torch.tensor([float("nan"), 1.0])), "reward_weights must be finite"),
    # a count on a device is refused, not read (reading it is a host synchronization)
    (dict(group_size=torch.tensor(4, device="meta")), "group_size must be a Python int or a CPU tensor"),
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
    for dtype in (torch.float32, torch.uint8, torch.int16, torch.bool):  # the kernels read int64 or int32 only
        with pytest.raises(ValueError, match=rf"step_end must be an int64 \(or int32\) tensor, got {dtype}"):
            impl.process_advantages(torch.rand(4, 2), torch.zeros(4, 2, dtype=dtype), 2, 5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool, torch.float32])
def test_ids_of_a_dtype_the_kernels_cannot_read_are_a_value_error(impl, dtype):
    """ids other than int64 or int32 are refused in Python, naming the argument, as a ValueError (an outside audit,
    2026-11-28: selective_log_softmax's int16 ids reached the native op's RuntimeError)."""
    logits, ids = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=dtype)
    with pytest.raises(ValueError, match=rf"ids must be an int64 \(or int32\) tensor, got {dtype}"):
        impl.selective_log_softmax(logits, ids)
    with pytest.raises(ValueError, match=rf"completion_ids must be an int64 \(or int32\) tensor, got {dtype}"):
        impl.grpo_loss_from_logits(logits, ids, torch.ones(2), torch.ones(2, 3))


@pytest.mark.parametrize("op", ["grpo_loss_forward", "grpo_loss_from_logits", "grpo_loss_from_logits_"])
@pytest.mark.parametrize("which", ["completion_mask", "sample_mask"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_native_ops_refuse_a_non_finite_mask(op, which, value):
    """The raw CPU ops refuse a NaN or inf mask value as the Python functions do (issue 40: grpo_loss_from_logits
    returned NaN; an outside audit, 2026-11-28: +inf gave NaN), with the same message."""
    mask, sample_mask = torch.ones(2, 3), torch.ones(2)
    (mask[1, 2] if which == "completion_mask" else sample_mask[1]).fill_(value)
    option_args = LossOptions(epsilon_high=0.2, max_completion_length=3, sample_mask=sample_mask).op_args()
    with pytest.raises(RuntimeError, match=f"{which} holds -?{value}; a mask's values must be finite"):
        if op == "grpo_loss_forward":
            torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), mask, *option_args, False)
        else:
            logits, ids = torch.randn(2, 3, 7), torch.zeros(2, 3, dtype=torch.int64)
            getattr(torch.ops.grpo_ext, op)(logits, ids, torch.rand(2), mask, *option_args,
                                            *LogitOptions().op_args(), 0.0, None, True)  # fmt: skip


def test_native_ops_check_their_inputs():
    """The raw torch.ops check too (TORCH_CHECK), for callers that skip the Python wrappers."""
    overlapping = torch.randn(100).as_strided((2, 3, 7), (7, 7, 1))  # rows (0, 1) and (1, 0) share memory
    option_args = LossOptions(epsilon_high=0.2, max_completion_length=3).op_args()
    with pytest.raises(RuntimeError, match=r"rows do not overlap in memory, got shape \[2, 3, 7\] with strides"):
        torch.ops.grpo_ext.grpo_loss_from_logits_(overlapping, torch.zeros(2, 3, dtype=torch.int64), torch.rand(2),
                                                  torch.ones(2, 3), *option_args, *LogitOptions().op_args(), 0.0,
                                                  None, True)  # fmt: skip
    with pytest.raises(RuntimeError, match="group_size must be >= 1"):
        torch.ops.grpo_ext.group_advantages(torch.rand(8), None, 0, "group", "mean", "sum_then_normalize", 1e-4, 1)
    with pytest.raises(RuntimeError, match="loss_type must be one of"):
        options = LossOptions(loss_type="ppo", epsilon_high=0.2, max_completion_length=3).op_args()
        torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), torch.ones(2, 3), *options, False)
    with pytest.raises(RuntimeError, match="completion_mask must have shape"):
        options = LossOptions(epsilon_high=0.2, max_completion_length=3).op_args()
        torch.ops.grpo_ext.grpo_loss_forward(torch.rand(2, 3), torch.rand(2), torch.ones(2, 4), *options, False)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
def test_token_rows_in_another_layout_are_refused(impl):
    """Ids, hidden states or reference hidden states in a [T, B] layout have the right number of rows in the wrong
    order; each is refused, naming it (an outside audit, 2026-11-28: both scored the wrong tokens)."""
    gen = torch.Generator().manual_seed(0)
    logits, hidden, weight = torch.randn(2, 3, 6, generator=gen), torch.randn(2, 3, 4, generator=gen), torch.randn(6, 4)
    ids, adv, mask = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"completion_ids must have shape \[B, T\]=\(2, 3\)"):
        impl.grpo_loss_from_logits(logits, ids.t().contiguous(), adv, mask)
    with pytest.raises(ValueError, match=r"hidden must have shape \[B, T, H\] with \[B, T\]=\(2, 3\)"):
        impl.grpo_loss_from_hidden(hidden.transpose(0, 1).contiguous(), weight, ids, adv, mask)
    with pytest.raises(ValueError, match=r"logits must have shape \[B, T, V\] with \[B, T\]=\(2, 3\)"):
        impl.grpo_loss_from_logits(logits.transpose(0, 1).contiguous(), ids, adv, mask)
    # the flat layouts stay accepted: [N] ids, [N, H] hidden states
    impl.grpo_loss_from_logits(logits, ids.reshape(-1), adv, mask)
    impl.grpo_loss_from_hidden(hidden.reshape(6, 4), weight, ids, adv, mask)
    if impl is grpo_ext:  # the reference head of the fused path
        from grpo_ext.ops.grpo_loss_from_hidden import hidden_loss

        with pytest.raises(ValueError, match=r"ref_input must have shape \[B, T, H\]"):
            hidden_loss(hidden, weight, ids, adv, mask, beta=0.1,
                        ref_head=(hidden.transpose(0, 1).contiguous(), weight, None))  # fmt: skip


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
def test_flags_given_as_strings_are_refused(impl):
    """A flag read from YAML or a command line as the string "false" is true in Python; each is refused, never
    taken as True (an outside audit, 2026-11-28: inplace_grad="false" overwrote the caller's logits)."""
    logits, ids = torch.randn(2, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="return_entropy must be a bool"):
        impl.selective_log_softmax(logits, ids, return_entropy="false")
    if impl is grpo_ext:
        x = torch.randn(1, 2, 4, requires_grad=True)
        produced = x * 1.0
        before = produced.detach().clone()
        with pytest.raises(ValueError, match="inplace_grad must be a bool"):
            grpo_ext.grpo_loss_from_logits(produced, torch.tensor([[1, 2]]), torch.tensor([1.0]), torch.ones(1, 2),
                                           inplace_grad="false")  # fmt: skip
        assert torch.equal(produced.detach(), before)


def test_numpy_bools_are_flags():
    """A numpy bool (an element of a numpy array or config) is taken as the bool it holds, at every flag: False does not
    overwrite the caller's logits, True does, and the loss options and nn module take them too."""
    import numpy as np
    logits, ids = torch.randn(2, 4), torch.tensor([0, 1])
    assert grpo_ext.selective_log_softmax(logits, ids, return_entropy=np.bool_(False)).entropy is None
    assert grpo_ext.selective_log_softmax(logits, ids, return_entropy=np.bool_(True)).entropy.shape == (2,)
    for flag in (np.bool_(False), np.bool_(True)):
        produced = torch.randn(1, 2, 4, requires_grad=True) * 1.0
        before = produced.detach().clone()
        out = grpo_ext.grpo_loss_from_logits(produced, torch.tensor([[1, 2]]), torch.tensor([1.0]), torch.ones(1, 2),
                                             inplace_grad=flag, return_token_logps=flag)  # fmt: skip
        out.loss.backward()
        assert torch.equal(produced.detach(), before) != bool(flag)  # only True writes the gradient over the logits
    out = grpo_ext.grpo_loss(torch.randn(2, 3), torch.randn(2), torch.ones(2, 3), skip_empty_rows=np.bool_(True),
                             use_bias_correction_kl=np.bool_(False))  # fmt: skip
    assert torch.isfinite(out.loss)
    from grpo_ext.nn import FusedLinearGRPOLoss

    module = FusedLinearGRPOLoss(use_ref_model=np.bool_(False), compiled=np.bool_(False))
    assert module.use_ref_model is False and module.compiled is False


def test_fused_linear_module_checks_its_settings():
    """FusedLinearGRPOLoss checks beta and its flags when built (without a reference, forward never reads beta),
    and its reference log-probs' type and reference bias' device when called."""
    from grpo_ext.nn import FusedLinearGRPOLoss

    for kwargs, match in ((dict(beta=float("nan")), "beta must be a finite number"), (dict(beta=-1.0), "beta"),
                          (dict(use_ref_model="false"), "use_ref_model must be a bool"),
                          (dict(compiled="yes"), "compiled must be a bool")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            FusedLinearGRPOLoss(**kwargs)
    h, weight = torch.randn(1, 2, 4), torch.randn(5, 4)
    ids, mask, adv = torch.tensor([[0, 1]]), torch.ones(1, 2), torch.tensor([1.0])
    with pytest.raises(ValueError, match="ref_per_token_logps must be a \\[B, T\\] tensor or None, got list"):
        FusedLinearGRPOLoss()(h, weight, ids, mask, adv, ref_per_token_logps=[[-1.0, -1.0]])
    with pytest.raises(ValueError, match="ref_bias must be a \\[V\\]=\\(5,\\) tensor of ref_input's dtype on cpu"):
        FusedLinearGRPOLoss()(h, weight, ids, mask, adv, ref_input=h, ref_weight=weight,
                              ref_bias=torch.zeros(5, device="meta"))  # fmt: skip


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["kernel", "reference"])
@pytest.mark.parametrize(("options", "factor"), [
    (dict(temperature=1e-39), "logit_scale / temperature"),
    (dict(logit_scale=1e39), "logit_scale / temperature"),
    (dict(temperature=1e30, logit_scale=1e-10), "logit_scale / temperature"),
    (dict(logit_softcap=1e-39), "logit_scale / logit_softcap"),
    (dict(logit_softcap=1e30, temperature=1e-10), "logit_softcap / temperature"),
])  # fmt: skip
def test_logit_factors_outside_float32_are_refused(impl, options, factor):
    """Options each valid alone whose factor in the kernels (float32) would be inf or 0 are refused, naming the factor
    (an outside audit, 2026-11-28: temperature=1e-39 gave NaN log-probs and loss from finite logits)."""
    logits, ids = torch.randn(1, 2, 5), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=f"{factor} must be a normal float32 number"):
        impl.selective_log_softmax(logits, ids, **options)
    with pytest.raises(ValueError, match=f"{factor} must be a normal float32 number"):
        impl.grpo_loss_from_logits(logits, ids, torch.tensor([1.0]), torch.ones(1, 2), **options)
    if impl is grpo_ext:  # the raw op checks the same
        from grpo_ext.validation.options import LogitOptions

        raw = LogitOptions(**{"temperature": 1.0, "logit_scale": 1.0} | options).op_args()
        with pytest.raises(RuntimeError, match=f"{factor} must be a normal float32 number"):
            torch.ops.grpo_ext.selective_log_softmax_forward(logits.reshape(2, 5), ids.reshape(2), *raw, False)
