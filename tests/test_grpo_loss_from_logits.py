"""grpo_ext.grpo_loss_from_logits (docs/math.md sections 2-7) against the materialized float64 reference."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, HAS_CUDA, assert_close, cast_kwargs
from grpo_ext import reference
from grpo_ext.validation.options import LOSS_TYPES, LossOptions


def make_problem(batch: int = 4, length: int = 6, vocab: int = 50, *, seed: int = 0, per_token_adv: bool = False):
    """Logits [B, T, V] (one confident token), ids, advantages, a mask with an empty row, old/ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    logits[1, 0, ids[1, 0]] += 40.0  # p -> 1: the gradient's 1 - p must not cancel
    mask = torch.rand(batch, length, generator=g) < 0.7
    mask[0] = False
    mask[1] = True
    adv = (
        torch.randn(batch, length, generator=g, dtype=torch.float64)
        if per_token_adv
        else torch.randn(batch, generator=g, dtype=torch.float64)
    )
    with torch.no_grad():
        base = reference.selective_log_softmax(logits, ids, temperature=0.9).logps
    old = base + 0.25 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    ref = base + 0.2 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    return logits, ids, adv, mask, old, ref


def run(impl, logits, ids, adv, mask, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    out = impl.grpo_loss_from_logits(x, ids, adv, mask, **kwargs)
    out.loss.backward()
    return out, x.grad


def assert_error_at_most_twice_reference(got, reference_low, truth) -> None:
    """flash-attention's rule on (loss, grad): each of ``got``'s errors against the float64 ``truth`` is at most twice
    that of ``reference_low`` (the reference in the same low precision)."""
    for name, a, r, t in zip(("loss", "grad"), got, reference_low, truth, strict=True):
        err = (a.double().cpu() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-7, (name, err, ref_err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_reference(device, loss_type, level):
    logits, ids, adv, mask, old, ref = make_problem(seed=LOSS_TYPES.index(loss_type))
    g = torch.Generator().manual_seed(5)
    is_weights = 0.5 + torch.rand(4, 6, generator=g, dtype=torch.float64)
    sample_mask = torch.tensor([True, True, False, True])
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.05, loss_type=loss_type, importance_sampling_level=level,
                  is_weights=is_weights, sample_mask=sample_mask, temperature=0.9, epsilon_high=0.28)  # fmt: skip
    if loss_type == "cispo":
        kwargs["epsilon_high"] = 1.2
    expected, expected_grad = run(reference, logits, ids, adv, mask, **kwargs)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got, grad = run(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype), mask.to(device),
                        **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert got.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert grad.dtype == dtype
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        assert_close(grad, expected_grad, rtol=10 * tol, atol=tol, msg=f"grad {dtype}")
        assert set(got.metrics) == set(expected.metrics)
        for name, value in expected.metrics.items():
            assert_close(got.metrics[name], value, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 7, 50257, 151936])
def test_vocabulary_sizes_and_temperature(device, vocab):
    logits, ids, adv, mask, old, ref = make_problem(2, 3, vocab, seed=vocab, per_token_adv=True)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.1, temperature=0.7, loss_type="dapo")
    expected, expected_grad = run(reference, logits, ids, adv, mask, **kwargs)
    got, grad = run(grpo_ext, logits.float().to(device), ids.to(device), adv.float().to(device), mask.to(device),
                    **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    assert_close(got.loss, expected.loss, rtol=2e-5, atol=2e-6)
    assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)
    assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("single_read", ["1", "small-blocks", "0"])
@pytest.mark.parametrize("vocab", [32000, 151936, 262144])
def test_single_read_and_two_read_passes(monkeypatch, single_read, vocab):
    """Rows staged in shared memory (GRPO_EXT_LOGITS_SINGLE_READ=1, or small-blocks, its earlier name: clusters of 3,
    11 and 14 blocks of 256 threads on an H100, the last two over the portable 8) and the two-read kernel (the
    default), each against the reference."""
    monkeypatch.setenv("GRPO_EXT_LOGITS_SINGLE_READ", single_read)
    logits, ids, adv, mask, old, ref = make_problem(2, 3, vocab, seed=vocab, per_token_adv=True)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.1, temperature=0.7, loss_type="dapo")
    expected, expected_grad = run(reference, logits, ids, adv, mask, **kwargs)
    got, grad = run(grpo_ext, logits.float().cuda(), ids.cuda(), adv.float().cuda(), mask.cuda(),
                    **cast_kwargs("cuda", torch.float32, kwargs))  # fmt: skip
    assert_close(got.loss, expected.loss, rtol=2e-5, atol=2e-6)
    assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)
    assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize(
    ("rows", "vocab", "dtype"),
    [
        (64, 1000, torch.float32),  # one block a row: no cluster, no exchange
        (64, 20000, torch.bfloat16),  # one block a row
        (4096, 32000, torch.bfloat16),  # clusters of 2 walking many rows when persistent: each inbox slot reused
        (128, 151936, torch.bfloat16),  # clusters of 6
    ],
)
def test_single_read_pass_over_many_rows_half_masked(monkeypatch, rows, vocab, dtype):
    """What the emulated device cannot vouch for (it runs one thread at a time, memory sequentially consistent): the
    single-read pass's mbarrier phases reused row after row, rows skipped by the mask between exchanges, low-precision
    logits, and a lone block's row; default and persistent clusters must agree bit for bit, and both with the
    two-read pass (a helper's review, 2026-11-29)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows // 64, 64, vocab, generator=g) * 3).to("cuda", dtype)
    ids = torch.randint(0, vocab, (rows // 64, 64), generator=g).cuda()
    adv = torch.randn(rows // 64, generator=g).cuda()
    mask = (torch.rand(rows // 64, 64, generator=g) < 0.5).float().cuda()

    def run_layout(**env):
        for name in ("GRPO_EXT_LOGITS_SINGLE_READ", "GRPO_EXT_LOGITS_PERSISTENT"):
            monkeypatch.setenv(name, env.get(name, "0"))
        x = logits.clone().requires_grad_(True)
        out = grpo_ext.grpo_loss_from_logits(x, ids, adv, mask, loss_type="dapo")
        out.loss.backward()
        return out.loss, x.grad

    two_read = run_layout()
    single = run_layout(GRPO_EXT_LOGITS_SINGLE_READ="1")
    persistent = run_layout(GRPO_EXT_LOGITS_SINGLE_READ="1", GRPO_EXT_LOGITS_PERSISTENT="1")
    assert torch.equal(single[0], persistent[0]) and torch.equal(single[1], persistent[1])
    assert torch.count_nonzero(single[1][mask == 0]) == 0
    assert_close(single[0], two_read[0], rtol=1e-5, atol=1e-6)
    assert_close(single[1].float(), two_read[1].float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("full_occupancy", ["1", "0"])
@pytest.mark.parametrize("low_precision", [torch.bfloat16, torch.float16])
def test_two_read_full_occupancy_build_error_at_most_twice_reference(monkeypatch, full_occupancy, low_precision):
    """The two-read kernel's 32-register build (GRPO_EXT_LOGITS_FULL_OCCUPANCY=1: bf16/fp16 logits, 8 blocks of 256
    threads an SM) and its default build, at Qwen2.5's vocabulary: the error against float64 at most twice that of
    the reference in the same dtype, for the loss and the logits' gradient."""
    monkeypatch.setenv("GRPO_EXT_LOGITS_SINGLE_READ", "0")
    monkeypatch.setenv("GRPO_EXT_LOGITS_FULL_OCCUPANCY", full_occupancy)
    logits, ids, adv, mask, old, ref = make_problem(2, 3, 151936, seed=7, per_token_adv=True)
    low = logits.to(low_precision)
    kwargs = dict(old_logps=old.float(), ref_logps=ref.float(), beta=0.04, temperature=0.7, loss_type="dapo")
    truth, truth_grad = run(reference, low.double(), ids, adv, mask, **cast_kwargs("cpu", torch.float64, kwargs))
    ref_low, ref_low_grad = run(reference, low, ids, adv.float(), mask, **kwargs)
    got, grad = run(grpo_ext, low.cuda(), ids.cuda(), adv.float().cuda(), mask.cuda(),
                    **cast_kwargs("cuda", torch.float32, kwargs))  # fmt: skip
    assert_error_at_most_twice_reference((got.loss, grad), (ref_low.loss, ref_low_grad), (truth.loss, truth_grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("low_precision", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_low_precision_error_at_most_twice_reference(device, low_precision, level):
    """flash-attention's rule: the error against float64 is at most twice the reference's in the same dtype."""
    logits, ids, adv, mask, old, ref = make_problem(4, 8, 4099, seed=3)
    low = logits.to(low_precision)
    kwargs = dict(old_logps=old.float(), ref_logps=ref.float(), beta=0.04, importance_sampling_level=level)
    truth, truth_grad = run(reference, low.double(), ids, adv, mask, **cast_kwargs("cpu", torch.float64, kwargs))
    ref_low, ref_low_grad = run(reference, low, ids, adv.float(), mask, **kwargs)
    got, grad = run(grpo_ext, low.to(device), ids.to(device), adv.float().to(device), mask.to(device),
                    **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    assert grad.dtype == low_precision
    assert_error_at_most_twice_reference((got.loss, grad), (ref_low.loss, ref_low_grad), (truth.loss, truth_grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_inplace_grad(device, level):
    logits, ids, adv, mask, old, ref = make_problem(seed=8)
    kwargs = dict(old_logps=old.float().to(device), ref_logps=ref.float().to(device), beta=0.02,
                  importance_sampling_level=level)  # fmt: skip
    ids, adv, mask = ids.to(device), adv.float().to(device), mask.to(device)
    # the logits come out of a matmul, which saves its inputs and not its output: in place is legal here
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 6, 16, generator=g).to(device).requires_grad_(True)
    weight = torch.randn(50, 16, generator=g).to(device)
    expected = grpo_ext.grpo_loss_from_logits(hidden @ weight.t(), ids, adv, mask, **kwargs)
    (expected_grad,) = torch.autograd.grad(expected.loss, hidden)
    logits = hidden @ weight.t()
    version = logits._version
    out = grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, inplace_grad=True, **kwargs)
    assert logits._version > version  # autograd can tell the values changed
    (grad,) = torch.autograd.grad(out.loss, hidden)
    assert torch.equal(out.loss, expected.loss)
    assert torch.equal(grad, expected_grad)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad_cannot_be_misused_silently(device):
    logits, ids, adv, mask, *_ = make_problem(seed=9)
    ids, adv, mask = ids.to(device), adv.float().to(device), mask.to(device)
    base = logits.float().to(device).requires_grad_(True)
    saved = torch.exp(base)  # exp saves its output for backward: overwriting it must make backward fail
    out = grpo_ext.grpo_loss_from_logits(saved, ids, adv, mask, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
    with pytest.raises(ValueError, match="leaf"):
        grpo_ext.grpo_loss_from_logits(base, ids, adv, mask, inplace_grad=True)
    strided = torch.randn(4, 50, 6, device=device).transpose(1, 2)  # [B, T, V] with stride(-1) == 6
    with pytest.raises(ValueError, match="contiguous in the vocabulary"):
        grpo_ext.grpo_loss_from_logits(strided, ids, adv, mask, inplace_grad=True)
    # rows sharing memory: every stride at least V, yet rows (0, 1) and (1, 0) are one (a helper's review, 2026-11-29:
    # the old check let it through, and two blocks would write one row at once); and a row broadcast over T
    storage = torch.randn(10 * 50, device=device, requires_grad=True) * 1.0  # not a leaf: in place is allowed
    for overlapping in (storage.as_strided((4, 6, 50), (50, 50, 1)), storage[:50].expand(4, 6, 50)):
        with pytest.raises(ValueError, match=r"rows do not overlap in memory, got shape \[4, 6, 50\] with strides"):
            grpo_ext.grpo_loss_from_logits(overlapping, ids, adv, mask, inplace_grad=True)
    # disjoint rows in other orders are taken: [T, B, V] seen as [B, T, V], and rows with gaps between them
    for layout in (lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), lambda t: torch.cat([t, t], -1)[..., :50]):
        leaf = logits.float().to(device).requires_grad_(True)
        expected = grpo_ext.grpo_loss_from_logits(layout(leaf), ids, adv, mask)
        (expected_grad,) = torch.autograd.grad(expected.loss, leaf)
        out = grpo_ext.grpo_loss_from_logits(layout(leaf), ids, adv, mask, inplace_grad=True)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        assert torch.equal(out.loss, expected.loss) and torch.equal(grad, expected_grad)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_flat_layouts(device):
    logits, ids, adv, mask, old, _ = make_problem(seed=11)
    expected, expected_grad = run(reference, logits, ids, adv, mask, old_logps=old)
    # a model's output is [B, T+1, V]; the loss takes [:, :-1] without a copy
    padded = torch.cat([logits, torch.randn(4, 1, 50, dtype=torch.float64)], dim=1).to(device).requires_grad_(True)
    view = padded[:, :-1]
    assert not view.is_contiguous()
    out = grpo_ext.grpo_loss_from_logits(view, ids.to(device), adv.to(device), mask.to(device),
                                         old_logps=old.to(device))  # fmt: skip
    out.loss.backward()
    assert_close(out.loss, expected.loss, rtol=1e-10, atol=1e-12)
    assert_close(padded.grad[:, :-1], expected_grad, rtol=1e-9, atol=1e-12)
    assert torch.count_nonzero(padded.grad[:, -1]) == 0
    flat = run(grpo_ext, logits.reshape(24, 50).to(device), ids.reshape(24).to(device), adv.to(device),
               mask.to(device), old_logps=old.to(device))  # fmt: skip
    assert_close(flat[0].loss, expected.loss, rtol=1e-10, atol=1e-12)
    assert_close(flat[1].reshape(4, 6, 50), expected_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_scaling_no_grad_and_determinism(device):
    logits, ids, adv, mask, old, ref = make_problem(seed=12)
    args = (ids.to(device), adv.float().to(device), mask.to(device))
    kwargs = dict(old_logps=old.float().to(device), ref_logps=ref.float().to(device), beta=0.1)
    x = logits.float().to(device).requires_grad_(True)
    once = grpo_ext.grpo_loss_from_logits(x, *args, **kwargs)
    (grad_once,) = torch.autograd.grad(once.loss, x)
    twice = grpo_ext.grpo_loss_from_logits(x, *args, **kwargs)
    (grad_twice,) = torch.autograd.grad(2.5 * twice.loss, x)
    assert torch.equal(once.loss, twice.loss)
    assert_close(grad_twice, 2.5 * grad_once, rtol=1e-6, atol=0)
    for _ in range(2):  # bitwise reproducible
        again = grpo_ext.grpo_loss_from_logits(x, *args, **kwargs)
        assert torch.equal(torch.autograd.grad(again.loss, x)[0], grad_once)
    with torch.no_grad():
        assert torch.equal(grpo_ext.grpo_loss_from_logits(x, *args, **kwargs).loss, once.loss)
    retained = grpo_ext.grpo_loss_from_logits(x, *args, **kwargs)
    retained.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        retained.loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    logits, ids, adv, mask, old, ref = make_problem(2, 3, 11, seed=13)
    x = logits.to(device)
    ids, adv, mask, old, ref = ids.to(device), adv.to(device), mask.to(device), old.to(device), ref.to(device)
    flat_ids = ids.reshape(-1)
    for token_grad, compute_grad in (
        (None, True),
        (None, False),
        (torch.randn(6, dtype=torch.float64, device=device), True),
    ):
        options = LossOptions(old_logps=old, ref_logps=ref, epsilon_high=0.2, beta=0.1, max_completion_length=3)
        for logit_args in ((0.9, 1.0, 0.0), (0.9, 0.7, 2.5)):  # (temperature, logit_scale, logit_softcap)
            args = (x, flat_ids, 0, adv, mask, token_grad, *options.op_args(), *logit_args, 0.0, None, compute_grad)
            torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_pass.default, args)
            torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_pass_.default, (x.clone(), *args[1:]))
    torch.library.opcheck(torch.ops.grpo_ext.scale_grad_.default, (x.clone(), torch.tensor(2.0, device=device)))
    options = LossOptions(old_logps=old, ref_logps=ref, loss_type="dapo", epsilon_high=0.28, beta=0.1,
                          max_completion_length=3)  # fmt: skip
    for logit_args in ((0.9, 1.0, 0.0), (0.9, 0.7, 2.5)):
        op_args = (x.requires_grad_(True), flat_ids, adv, mask, *options.op_args(), *logit_args, 0.0, None)
        for compute_grad in (True, False):
            torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits.default, (*op_args, compute_grad))
            inplace_args = (x.detach().clone(), *op_args[1:], compute_grad)
            torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_.default, inplace_args)

    def fn(t):
        out = grpo_ext.grpo_loss_from_logits(t, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.1,
                                             temperature=0.9, logit_scale=0.7, logit_softcap=2.5)  # fmt: skip
        return out.loss + 0.0 * out.metrics["entropy"]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    (expected_grad,) = torch.autograd.grad(fn(x), x)
    value = compiled(x)
    (grad,) = torch.autograd.grad(value, x)
    assert_close(value, fn(x), rtol=1e-12, atol=1e-12)
    assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)

    def inplace_fn(t):
        return grpo_ext.grpo_loss_from_logits(t * 1.0, ids, adv, mask, inplace_grad=True).loss

    torch._dynamo.reset()
    with pytest.raises(Exception, match="inplace_grad=True is for eager mode"):
        torch.compile(inplace_fn, fullgraph=True, backend="aot_eager")(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit_scale,logit_softcap", [(0.6, None), (1.0, 3.0), (1.7, 2.5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logit_scale_and_softcap_match_reference(device, logit_scale, logit_softcap, level):
    """docs/math.md section 2's scale, then cap, then temperature; the gradient with respect to the raw logits."""
    logits, ids, adv, mask, old, ref = make_problem(seed=21)
    g = torch.Generator().manual_seed(3)  # old and ref near the policy's own log-probs under these options
    own = reference.selective_log_softmax(logits, ids, temperature=0.9, logit_scale=logit_scale,
                                          logit_softcap=logit_softcap).logps  # fmt: skip
    old = own + 0.25 * torch.randn(own.shape, generator=g, dtype=torch.float64)
    ref = own + 0.2 * torch.randn(own.shape, generator=g, dtype=torch.float64)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.05, importance_sampling_level=level, temperature=0.9,
                  logit_scale=logit_scale, logit_softcap=logit_softcap)  # fmt: skip
    expected, expected_grad = run(reference, logits, ids, adv, mask, **kwargs)
    _, plain_grad = run(reference, logits, ids, adv, mask, **{**kwargs, "logit_scale": 1.0, "logit_softcap": None})
    assert (plain_grad - expected_grad).abs().max() > 1e-4  # the options matter here: ignoring them would fail
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got, grad = run(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype), mask.to(device),
                        **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        assert_close(grad, expected_grad, rtol=10 * tol, atol=tol, msg=f"grad {dtype}")
        assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=tol, atol=tol, msg=f"entropy {dtype}")
    low = logits.to(torch.bfloat16)  # bf16 logits: error at most twice the reference's in bf16
    truth, truth_grad = run(reference, low.double(), ids, adv, mask, **kwargs)
    ref_low, ref_low_grad = run(reference, low, ids, adv.float(), mask, **cast_kwargs("cpu", torch.float32, kwargs))
    got, grad = run(grpo_ext, low.to(device), ids.to(device), adv.float().to(device), mask.to(device),
                    **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    for name, a, r, t in (("loss", got.loss, ref_low.loss, truth.loss), ("grad", grad, ref_low_grad, truth_grad)):
        err = (a.double().cpu() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-7, (name, err, ref_err)
    # in place: the same gradient written over the logits
    x = logits.float().to(device).requires_grad_(True)
    expected_f32, grad_f32 = run(grpo_ext, x.detach(), ids.to(device), adv.float().to(device), mask.to(device),
                                 **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    produced = x * 1.0
    out = grpo_ext.grpo_loss_from_logits(produced, ids.to(device), adv.float().to(device), mask.to(device),
                                         inplace_grad=True, **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    (grad_inplace,) = torch.autograd.grad(out.loss, x)
    assert torch.equal(out.loss, expected_f32.loss)
    assert torch.equal(grad_inplace, grad_f32)


def test_the_reference_takes_the_ops_call():
    """The op's call with ``inplace_grad`` and ``return_token_logps`` runs unchanged on the reference, which returns
    the same per-token log-probs and entropies (0 where not kept) and never writes over its logits."""
    logits, ids, adv, mask, old, _ = make_problem(seed=18)
    sample_mask = torch.tensor([True] * (mask.shape[0] - 1) + [False])
    kwargs = dict(old_logps=old, temperature=0.9, sample_mask=sample_mask, return_token_logps=True)
    kept = mask & sample_mask.unsqueeze(1)
    fused = grpo_ext.grpo_loss_from_logits(logits.clone(), ids, adv, mask, inplace_grad=True, **kwargs)
    before = logits.clone()
    out = reference.grpo_loss_from_logits(logits, ids, adv, mask, inplace_grad=True, **kwargs)
    assert torch.equal(logits, before)
    assert isinstance(out, grpo_ext.GRPOLossTokenOutput)
    assert not out.token_logps.requires_grad and not out.token_entropy.requires_grad
    assert (out.token_logps[~kept] == 0).all() and (out.token_entropy[~kept] == 0).all()
    assert_close(out.loss, fused.loss, rtol=1e-10, atol=1e-12)
    assert_close(out.token_logps, fused.token_logps, rtol=1e-10, atol=1e-12, msg="logps")
    assert_close(out.token_entropy, fused.token_entropy, rtol=1e-10, atol=1e-12, msg="entropy")
    with pytest.raises(ValueError, match="inplace_grad"):
        reference.grpo_loss_from_logits(logits, ids, adv, mask, inplace_grad="yes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_return_token_logps(device, inplace_grad):
    """The logits loss returns the [B, T] log-probs and entropies its pass computed (0 at the tokens never read)."""
    logits, ids, adv, mask, old, _ = make_problem(seed=17)
    expected = reference.selective_log_softmax(logits, ids, temperature=0.9, return_entropy=True)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        leaf = logits.detach().to(device, dtype).clone().requires_grad_(True)
        out = grpo_ext.grpo_loss_from_logits(leaf * 1.0, ids.to(device), adv.to(device, dtype), mask.to(device),
                                             old_logps=old.to(device, dtype), temperature=0.9,
                                             inplace_grad=inplace_grad, return_token_logps=True)  # fmt: skip
        out.loss.backward()
        assert isinstance(out, grpo_ext.GRPOLossTokenOutput) and leaf.grad is not None
        assert_close(out.token_logps, torch.where(mask, expected.logps, 0.0), rtol=tol, atol=tol, msg="logps")
        assert_close(out.token_entropy, torch.where(mask, expected.entropy, 0.0), rtol=tol, atol=tol, msg="entropy")
