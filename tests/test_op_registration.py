"""The ops as torch ops: opcheck (schema, fake, autograd registration, AOT), gradcheck, torch.compile, build info."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_ext
from conftest import DEVICES, HAS_CUDA, assert_close, make_loss_batch
from grpo_ext import reference
from grpo_ext.ops import OP_NAMES
from grpo_ext.validation.options import LossOptions

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _loss_forward_args(batch, **overrides):
    options = dict(
        old_logps=batch.old_logps, ref_logps=batch.ref_logps, is_weights=batch.is_weights,
        sample_mask=batch.sample_mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.28, delta=1.5, beta=0.04,
        kl_estimator="k3", kl_clamp=10.0, use_bias_correction_kl=False, importance_sampling_level="token",
        max_completion_length=batch.logps.shape[1], sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        loss_scale=1.0,
    )  # fmt: skip
    options.update(overrides)
    logps = batch.logps.clone().requires_grad_(True)
    return (logps, batch.advantages, batch.mask, *LossOptions(**options).op_args(), True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token")])
def test_opcheck_grpo_loss_forward(device, loss_type, level):
    batch = make_loss_batch(seed=1).to(device, torch.float32)
    args = _loss_forward_args(batch, loss_type=loss_type, importance_sampling_level=level)
    torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_forward.default, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_grpo_loss_backward(device):
    grad_raw = torch.randn(4, 5, device=device)
    args = (torch.tensor(2.0, device=device), grad_raw, torch.tensor(0.5, device=device), torch.bfloat16)
    torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_backward.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_advantage_ops(device):
    rewards = torch.randn(12, 2, device=device)
    weights = torch.tensor([1.0, 0.5], device=device)
    for scale in ("group", "batch"):
        torch.library.opcheck(
            torch.ops.grpo_ext.group_advantages.default,
            (rewards, weights, 4, scale, "mean", "sum_then_normalize", 1e-4, 1),
        )
    step_rewards = torch.randn(6, 3, device=device)
    step_end = torch.tensor([[0, 2, 5]] * 6, device=device)
    torch.library.opcheck(torch.ops.grpo_ext.process_advantages.default, (step_rewards, step_end, 3, 7, 1e-4, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_float64(device, loss_type, level):
    """Finite differences through the fused kernel itself (float64 instantiation).

    cispo is left out: its ratio is a stop-gradient weight, which finite differences cannot see; its gradient is
    compared with the reference's autograd in test_grpo_loss.py instead.
    """
    batch = make_loss_batch(seed=21, batch=4, seq_len=6, group_size=2).to(device, torch.float64)
    for bias in (False, True):
        def loss_fn(logps, batch=batch, bias=bias):
            return grpo_ext.grpo_loss(
                logps, batch.advantages, batch.mask, old_logps=batch.old_logps, ref_logps=batch.ref_logps,
                is_weights=batch.is_weights, beta=0.3, kl_clamp=0.25, use_bias_correction_kl=bias, delta=1.4,
                loss_type=loss_type, importance_sampling_level=level,
            ).loss  # fmt: skip

        logps = batch.logps.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(loss_fn, (logps,), eps=1e-7, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [None, torch.float32], ids=["batch_mask", "float_mask"])
def test_torch_compile_fullgraph(device, mask_dtype):
    """The ops under fullgraph compile, with the batch's mask and with a float mask of weights (math.md "Masks"),
    whose CPU values the Python check does not read under compile (the native op checks them when it runs), and with
    loss_scale and num_items_in_batch as tensor inputs of the graph (the ops take them as tensors: no value read)."""
    torch._dynamo.reset()
    batch = make_loss_batch(seed=2, batch=8, seq_len=16).to(device, torch.float32)
    rewards = torch.rand(8, device=device)
    mask = batch.mask if mask_dtype is None else batch.mask.to(mask_dtype) * 0.75
    scale, num_items = torch.tensor(0.5, device=device), torch.tensor(40.0, device=device)

    def step(logps, rewards, scale, num_items):
        adv = grpo_ext.group_advantages(rewards, 4).advantages
        out = grpo_ext.grpo_loss(logps, adv, mask, old_logps=batch.old_logps, ref_logps=batch.ref_logps, beta=0.04,
                                 loss_type="dapo", loss_scale=scale, num_items_in_batch=num_items)  # fmt: skip
        return out.loss, out.metrics["kl"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    l_eager = batch.logps.clone().requires_grad_(True)
    l_comp = batch.logps.clone().requires_grad_(True)
    loss_e, kl_e = step(l_eager, rewards, scale, num_items)
    loss_c, kl_c = compiled(l_comp, rewards, scale, num_items)
    loss_e.backward()
    loss_c.backward()
    assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    assert_close(kl_c, kl_e, rtol=1e-6, atol=1e-7)
    assert_close(l_comp.grad, l_eager.grad, rtol=1e-6, atol=1e-9)
    if device == "cpu" and mask_dtype is not None:  # an inf mask value is still refused, by the op itself
        mask[0, 0] = float("inf")
        with pytest.raises(RuntimeError, match="completion_mask holds inf"):
            compiled(batch.logps.clone().requires_grad_(True), rewards, scale, num_items)


@pytest.mark.parametrize("impl", [grpo_ext, reference], ids=["kernel", "reference"])
def test_a_loss_input_that_is_not_differentiated_gives_no_gradient_to_ask_for(impl):
    """advantages, old_logps and ref_logps are not differentiated: when they require grad and the scored input
    (logps, logits, hidden states) does not, the loss needs no gradient (an outside audit, 2026-11-28: it required
    one, and backward raised "the forward ran without computing the gradient")."""
    gen = torch.Generator().manual_seed(3)
    adv = torch.tensor([1.0, -1.0]).requires_grad_(True)
    old = (-torch.rand(2, 3, generator=gen)).requires_grad_(True)
    ids, mask = torch.randint(0, 5, (2, 3), generator=gen), torch.ones(2, 3)
    losses = {
        "grpo_loss": impl.grpo_loss(-torch.rand(2, 3, generator=gen), adv, mask, old_logps=old),
        "logits": impl.grpo_loss_from_logits(torch.randn(2, 3, 5, generator=gen), ids, adv, mask, old_logps=old),
        "hidden": impl.grpo_loss_from_hidden(torch.randn(2, 3, 4, generator=gen), torch.randn(5, 4, generator=gen),
                                             ids, adv, mask, old_logps=old),
    }  # fmt: skip
    assert {name: out.loss.requires_grad for name, out in losses.items()} == dict.fromkeys(losses, False)
    if impl is grpo_ext:  # traced, the op's registration gives the others no gradient instead of raising
        torch._dynamo.reset()
        logps = -torch.rand(2, 3, generator=gen)
        compiled = torch.compile(lambda a: grpo_ext.grpo_loss(logps, a, mask).loss, fullgraph=True, backend="aot_eager")
        loss = compiled(adv)
        if loss.requires_grad:
            loss.backward()
        assert adv.grad is None


def test_meta_inputs_give_the_output_shapes():
    """Every op on meta tensors (shapes, no values: model tracing) returns outputs of the right shapes, with the
    options a caller passes as tensors or lists (an outside audit, 2026-11-28: a meta loss_scale, list reward
    weights and meta hidden states each raised torch's "cannot copy out of meta tensor")."""
    meta = dict(device="meta")
    logps, adv, mask = torch.empty(2, 3, **meta), torch.empty(2, **meta), torch.empty(2, 3, **meta)
    for loss_scale in (torch.tensor(2.0), torch.tensor(2.0, **meta)):
        out = grpo_ext.grpo_loss(logps, adv, mask, loss_scale=loss_scale)
        assert out.loss.device.type == "meta" and out.loss.shape == ()
    rewards = torch.empty(8, 3, **meta)
    out = grpo_ext.group_advantages(rewards, 4, reward_weights=[1.0, 2.0, 3.0])
    assert out.advantages.shape == (8,) and out.group_mean.shape == (2,)
    hidden = torch.empty(2, 3, 4, **meta, requires_grad=True)
    weight = torch.empty(6, 4, **meta, requires_grad=True)
    ids = torch.empty(2, 3, dtype=torch.int64, **meta)
    out = grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask)
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    with pytest.raises(ValueError, match="hidden must have a hidden size H >= 1"):
        grpo_ext.grpo_loss_from_hidden(torch.randn(2, 3, 0), torch.randn(6, 0), torch.zeros(2, 3, dtype=torch.int64),
                                       torch.ones(2), torch.ones(2, 3))  # fmt: skip


def test_fake_inputs_give_the_output_shapes():
    """Every op under torch's FakeTensorMode outside torch.compile (shapes, no values: tracers and memory estimators)
    returns outputs of the right shapes, with float masks, tensor numbers and weights, group_ids with num_groups, and
    the hidden-state loss's kept rows; group_ids without num_groups is refused naming it (an outside audit,
    2026-11-29: each raised torch's DataDependentOutputException or DynamicOutputShapeException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logps, adv, mask = torch.empty(2, 3), torch.empty(2), torch.ones(2, 3)
        ids = torch.zeros(2, 3, dtype=torch.int64)
        out = grpo_ext.grpo_loss(logps, adv, mask, loss_scale=torch.tensor(2.0), num_items_in_batch=torch.tensor(6.0),
                                 loss_type="dapo")  # fmt: skip
        assert out.loss.shape == () and all(value.shape == () for value in out.metrics.values())
        assert grpo_ext.grpo_loss_from_logits(torch.empty(2, 3, 5), ids, adv, mask).loss.shape == ()
        hidden = torch.empty(2, 3, 4, requires_grad=True)
        grpo_ext.grpo_loss_from_hidden(hidden, torch.empty(5, 4), ids, adv, mask.bool()).loss.backward()
        assert hidden.grad.shape == hidden.shape
        advantages = grpo_ext.group_advantages(torch.empty(8, 2), 4, reward_weights=torch.tensor([1.0, 2.0]))
        assert advantages.advantages.shape == (8,) and advantages.group_std.shape == (2,)
        group_ids = torch.zeros(8, dtype=torch.int64)
        assert grpo_ext.group_advantages(torch.empty(8), group_ids=group_ids, num_groups=2).group_mean.shape == (2,)
        with pytest.raises(ValueError, match=r"num_groups is required with group_ids on the meta device or fake"):
            grpo_ext.group_advantages(torch.empty(8), group_ids=group_ids)
        assert grpo_ext.selective_log_softmax(torch.empty(4, 5), torch.zeros(4, dtype=torch.int64)).logps.shape == (4,)


def test_tensor_numbers_reach_the_ops_unread():
    """loss_scale and num_items_in_batch given as tensors go to the native ops as those tensors, beside their number
    arguments' placeholders, in the full validation's arguments and the per-call fast path's alike, and back."""
    from grpo_ext.validation import resolve_grpo_loss_args
    from grpo_ext.validation.options import NATIVE_OPTION_NAMES, LossOptions

    scale, num_items = torch.tensor(0.5), torch.tensor(7.0)
    options = LossOptions(loss_type="dapo", loss_scale=scale, num_items_in_batch=num_items)
    logps, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    _, fast_args = resolve_grpo_loss_args("grpo_loss", logps, adv, mask, options._asdict())
    for op_args in (options.op_args(), fast_args):
        args = dict(zip(NATIVE_OPTION_NAMES, op_args, strict=True))
        assert args["loss_scale"] == 1.0 and args["loss_scale_tensor"] is scale
        assert args["num_items_in_batch"] is None and args["num_items_tensor"] is num_items
        back = LossOptions.from_op_args(op_args)
        assert back.loss_scale is scale and back.num_items_in_batch is num_items and back.loss_type == "dapo"
    number_args = dict(zip(NATIVE_OPTION_NAMES, LossOptions(loss_scale=2, num_items_in_batch=3).op_args(), strict=True))
    assert number_args["loss_scale"] == 2.0 and number_args["loss_scale_tensor"] is None
    assert number_args["num_items_in_batch"] == 3.0 and number_args["num_items_tensor"] is None


def test_build_info():
    info = grpo_ext.build_info()
    assert info["version"] == grpo_ext.__version__
    assert info["torch_runtime_version"] == torch.__version__
    # the binary's stable-ABI target is never newer than the torch running it (else the import refuses)
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(int(p) for p in info["torch_min_version"].split(".")) <= major_minor
    assert all(Path(path).is_file() for path in info["libraries"])
    assert len(info["libraries"]) == (2 if info["cuda_kernels_registered"] else 1)
    for name in OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"grpo_ext::{name}", "CPU"), name
    # _C_cuda.so is loaded when it was compiled and torch is a CUDA build: a CPU-only torch gets the CPU kernels only
    assert info["cuda_kernels_registered"] == (info["cuda_compiled"] and torch.version.cuda is not None)
    if HAS_CUDA:
        assert info["cuda_compiled"], "a GPU is visible but the CUDA kernels were not compiled"


def test_import_under_an_older_torch_names_both_versions(tmp_path):
    """A torch older than the binary's stable-ABI target gets one ImportError naming both versions, before any
    library is loaded (a missing stable-shim symbol would otherwise end the process)."""
    code = "import torch; torch.__version__ = '2.10.1+cu128'; import grpo_ext"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    minimum = grpo_ext.build_info()["torch_min_version"]
    assert last_line.startswith("ImportError: grpo_ext"), result.stderr
    assert f"torch >= {minimum}" in last_line and "2.10.1+cu128" in last_line, last_line


def test_loss_options_defined_once():
    """The native schema's options (csrc/plan/loss_options.h) are LossOptions' fields, in order, and every public loss
    function (kernels and reference) takes exactly them as keywords, with LossOptions' defaults."""
    import inspect

    from grpo_ext.validation.options import NATIVE_OPTION_NAMES, LossOptions

    schema_names = tuple(arg.split()[-1] for arg in grpo_ext._native.LOSS_OPTIONS_SCHEMA.strip(", ").split(", "))
    assert schema_names == NATIVE_OPTION_NAMES
    for impl in (grpo_ext, grpo_ext.reference):
        for function in (impl.grpo_loss, impl.grpo_loss_from_logits, impl.grpo_loss_from_hidden):
            keywords = {name: p.default for name, p in inspect.signature(function).parameters.items()
                        if p.kind is inspect.Parameter.KEYWORD_ONLY and name in LossOptions._fields}  # fmt: skip
            assert keywords == LossOptions._field_defaults, function
    with pytest.raises(TypeError, match="unexpected keyword"):
        grpo_ext.grpo_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), epsilon_low=0.2)


@pytest.mark.parametrize("name", ["group_advantages", "process_advantages", "selective_log_softmax", "grpo_loss",
                                  "grpo_loss_from_logits", "grpo_loss_from_hidden"])
def test_each_reference_takes_its_ops_arguments(name):
    """``grpo_ext.reference.X`` takes every parameter of ``grpo_ext.X`` (name, kind, default), so that a call to the op
    runs unchanged on the reference (an outside audit, 2026-11-29: the references lacked ``compute_dtype``,
    ``inplace_grad`` and ``return_token_logps``, and a call with them raised a TypeError naming grpo_loss)."""
    import inspect

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(getattr(reference, name)) == parameters(getattr(grpo_ext, name))


def test_torch_func_transforms_name_the_op_and_the_reference_supports_them():
    """torch.func.grad over a kernel loss raises naming the op and the ways out (an outside audit, 2026-11-29:
    torch's "must override the setup_context staticmethod" named neither); the reference's gradients under
    torch.func.grad and nested jacrev equal autograd's (its autograd Functions are torch.func-ready)."""
    gen = torch.Generator().manual_seed(8)
    logps = -torch.rand(2, 3, generator=gen, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    logits, ids = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64), torch.randint(0, 7, (2, 3), generator=gen)
    hidden, weight = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(7, 4, generator=gen).double()
    options = dict(old_logps=logps - 0.1, ref_logps=logps + 0.2, beta=0.1, use_bias_correction_kl=True)
    losses = {
        "grpo_loss": (lambda impl, x: impl.grpo_loss(x, adv, mask, **options).loss, logps),
        "grpo_loss_from_logits": (lambda impl, x: impl.grpo_loss_from_logits(x, ids, adv, mask, entropy_coef=0.1,
                                                                             **options).loss, logits),
        "selective_log_softmax": (lambda impl, x: impl.selective_log_softmax(x, ids).logps.sum(), logits),
        "grpo_loss_from_hidden": (lambda impl, x: impl.grpo_loss_from_hidden(x, weight, ids, adv, mask).loss,
                                  hidden),
    }  # fmt: skip
    for name, (loss, x) in losses.items():
        with pytest.raises(RuntimeError, match=rf"grpo_ext\.{name} does not support torch\.func's transforms .* "
                                               rf"grpo_ext\.reference\.{name}, which supports them"):  # fmt: skip
            torch.func.grad(lambda t, loss=loss: loss(grpo_ext, t))(x)
        leaf = x.clone().requires_grad_(True)
        expected = torch.autograd.grad(loss(reference, leaf), leaf)[0]
        torch.testing.assert_close(torch.func.grad(lambda t, loss=loss: loss(reference, t))(x), expected)
    second = torch.func.jacrev(torch.func.jacrev(lambda t: losses["grpo_loss"][0](reference, t)))(logps)
    leaf = logps.clone().requires_grad_(True)
    (first,) = torch.autograd.grad(losses["grpo_loss"][0](reference, leaf), leaf, create_graph=True)
    torch.testing.assert_close(second[1, 2], torch.autograd.grad(first[1, 2], leaf)[0])


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(old_logps=True, ref_logps=True, beta=0.1, use_bias_correction_kl=True),
        dict(old_logps=True, ref_logps=True, beta=0.1, kl_estimator="abs", importance_sampling_level="sequence"),
        dict(old_logps=True, loss_type="sapo"),
    ],
    ids=["plain", "bias-corrected k3", "abs sequence", "sapo"],
)
def test_the_reference_supports_forward_mode_transforms(options):
    """torch.func.jvp, jacfwd and hessian (forward over reverse) over the reference ops, which the kernels' error
    names as the way to torch.func's transforms (an outside check, 2026-11-29: every one raised "You must implement
    the jvp function" from the reference's autograd Functions): hessian equals nested jacrev, and a jvp equals the
    gradient's dot product with the tangent."""
    gen = torch.Generator().manual_seed(9)
    logps = -torch.rand(2, 3, generator=gen, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    ids = torch.randint(0, 7, (2, 3), generator=gen)
    logits, hidden = torch.randn(2, 3, 7, generator=gen).double(), torch.randn(2, 3, 4, generator=gen).double()
    weight = torch.randn(7, 4, generator=gen).double()
    kwargs = dict(options)
    if kwargs.pop("old_logps", False):
        kwargs["old_logps"] = logps - 0.1 * torch.randn(2, 3, generator=gen).double()
    if kwargs.pop("ref_logps", False):
        kwargs["ref_logps"] = logps + 0.2
    losses = {
        "grpo_loss": (lambda x: reference.grpo_loss(x, adv, mask, **kwargs).loss, logps),
        "grpo_loss_from_logits": (lambda x: reference.grpo_loss_from_logits(x, ids, adv, mask, entropy_coef=0.1,
                                                                            **kwargs).loss, logits),
        "grpo_loss_from_hidden": (lambda x: reference.grpo_loss_from_hidden(x, weight, ids, adv, mask, **kwargs).loss,
                                  hidden),
        "selective_log_softmax": (lambda x: reference.selective_log_softmax(x, ids, return_entropy=True).entropy.sum(),
                                  logits),
        # scale, soft cap and temperature, and a vocabulary entry masked out (-inf): p log p is 0 there
        "selective_log_softmax, capped": (lambda x: (lambda out: out.logps.sum() + 0.3 * out.entropy.sum())(
            reference.selective_log_softmax(x, ids.clamp(max=5), temperature=0.7, logit_scale=1.3, logit_softcap=2.0,
                                            return_entropy=True)), logits.index_fill(-1, torch.tensor([6]), -math.inf)),
    }  # fmt: skip
    for name, (loss, x) in losses.items():
        hessian = torch.func.hessian(loss)(x)
        torch.testing.assert_close(hessian, torch.func.jacrev(torch.func.jacrev(loss))(x), msg=name)
        tangent = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        _, directional = torch.func.jvp(loss, (x,), (tangent,))
        torch.testing.assert_close(directional, (torch.func.grad(loss)(x) * tangent).sum(), msg=name)


@pytest.mark.parametrize("estimator", ["k3", "k2", "abs", "low_var_kl", "k1"])
def test_the_references_forward_mode_derivative_at_an_overflowed_ratio_is_the_limit(estimator):
    """Forward mode follows docs/math.md section 8's overflow rules as the backward does: at d = 3000 (rho = +inf in
    float64) a clipped token's and a zero KL's derivative is 0, not 0 * inf = NaN; each jvp along a unit tangent
    equals the gradient's entry."""
    logps = torch.tensor([[-1.0, -2.0, -1.5]], dtype=torch.float64)
    log_ratio = torch.tensor([[3000.0, 3000.0, 0.1]], dtype=torch.float64)
    kwargs = dict(old_logps=logps - log_ratio, ref_logps=logps + torch.tensor([[0.0, 1.0, 0.1]], dtype=torch.float64),
                  beta=0.1, use_bias_correction_kl=True, kl_estimator=estimator, kl_clamp=0.2, loss_type="dapo")
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3)

    def loss(x):
        return reference.grpo_loss(x, adv, mask, **kwargs).loss

    gradient = torch.func.grad(loss)(logps)
    directional = torch.stack([torch.func.jvp(loss, (logps,), (unit.reshape(1, 3),))[1]
                               for unit in torch.eye(3, dtype=torch.float64)])  # fmt: skip
    assert not directional.isnan().any()
    torch.testing.assert_close(directional, gradient.reshape(3))
    if estimator != "k1":  # k1's gradient is 1 at r = 0; the others' are 0, and the ratio's clipped
        assert directional[0].item() == 0.0
