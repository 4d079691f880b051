"""grpo_ext.grpo_loss_from_hidden (chunked lm_head + fused loss) against the materialized float64 reference."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close, cast_kwargs
from grpo_ext import reference
from grpo_ext.ops.grpo_loss_from_hidden import hidden_loss
from grpo_ext.validation import validate_grpo_loss_args
from grpo_ext.validation.options import LOSS_TYPES, LossOptions


def make_problem(batch: int = 4, length: int = 5, size: int = 16, vocab: int = 37, *, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, size, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(vocab, size, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) < 0.75
    mask[0] = False
    mask[1] = True
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logps = reference.selective_log_softmax(hidden @ weight.t() + bias, ids, temperature=0.8).logps
    old = logps + 0.25 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    return hidden, weight, bias, ids, adv, mask, old, ref


def run(impl, hidden, weight, bias, ids, adv, mask, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = impl.grpo_loss_from_hidden(leaves[0], leaves[1], ids, adv, mask, lm_head_bias=leaves[2], **kwargs)
    out.loss.backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_reference(device, loss_type, level):
    hidden, weight, bias, ids, adv, mask, old, ref = make_problem(seed=LOSS_TYPES.index(loss_type))
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.05, loss_type=loss_type, importance_sampling_level=level,
                  temperature=0.8, sample_mask=torch.tensor([True, True, True, False]))  # fmt: skip
    expected, expected_grads = run(reference, hidden, weight, bias, ids, adv, mask, **kwargs)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 3e-5)):
        # chunks of 3 rows: chunks straddle sequences, and the last one is partial
        got, grads = run(grpo_ext, hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype),
                         ids.to(device), adv.to(device, dtype), mask.to(device), chunk_size=3,
                         **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        for name, a, b in zip(("hidden", "weight", "bias"), grads, expected_grads, strict=True):
            assert a.dtype == dtype
            assert_close(a, b, rtol=10 * tol, atol=tol, msg=f"grad {name} {dtype}")
        for name, value in expected.metrics.items():
            assert_close(got.metrics[name], value, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_size_does_not_change_the_result(device):
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(seed=20)
    args = [t.to(device) for t in (hidden, weight, bias, ids, adv, mask)]
    results = [run(grpo_ext, *args, old_logps=old.to(device), chunk_size=c, loss_type="dapo") for c in (1, 7, 20, 64)]
    for out, grads in results[1:]:
        assert_close(out.loss, results[0][0].loss, rtol=1e-12, atol=1e-14)
        for a, b in zip(grads, results[0][1], strict=True):
            assert_close(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_requires_grad_no_bias_and_no_grad(device):
    hidden, weight, _, ids, adv, mask, old, _ = make_problem(seed=21)
    hidden, weight, ids, adv, mask, old = (t.to(device) for t in (hidden, weight, ids, adv, mask, old))
    w = weight.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss_from_hidden(hidden, w, ids, adv, mask, old_logps=old, chunk_size=4)
    out.loss.backward()
    w_ref = weight.clone().requires_grad_(True)
    expected = reference.grpo_loss_from_hidden(hidden, w_ref, ids, adv, mask, old_logps=old)
    expected.loss.backward()
    assert_close(out.loss, expected.loss, rtol=1e-10, atol=1e-12)
    assert_close(w.grad, w_ref.grad, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        no_grad = grpo_ext.grpo_loss_from_hidden(hidden, w, ids, adv, mask, old_logps=old)
    assert_close(no_grad.loss, expected.loss, rtol=1e-10, atol=1e-12)
    h = hidden.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss_from_hidden(h, weight, ids, adv, mask, old_logps=old)
    (2.0 * out.loss).backward()  # grad_output != 1 scales every gradient
    h_ref = hidden.clone().requires_grad_(True)
    (2.0 * reference.grpo_loss_from_hidden(h_ref, weight, ids, adv, mask, old_logps=old).loss).backward()
    assert_close(h.grad, h_ref.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [5, None])  # None: one chunk, the weight gradient in bf16 straight away
def test_low_precision_error_at_most_twice_reference(device, chunk_size):
    hidden, weight, bias, ids, adv, mask, old, ref = make_problem(4, 6, 64, 300, seed=22)
    low = [t.to(torch.bfloat16) for t in (hidden, weight, bias)]
    kwargs = dict(old_logps=old.float(), ref_logps=ref.float(), beta=0.04)
    truth, truth_grads = run(
        reference, *[t.double() for t in low], ids, adv, mask, **cast_kwargs("cpu", torch.float64, kwargs)
    )
    ref_low, ref_grads = run(reference, *low, ids, adv.float(), mask, **kwargs)
    got, grads = run(grpo_ext, *[t.to(device) for t in low], ids.to(device), adv.float().to(device),
                     mask.to(device), chunk_size=chunk_size, **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    assert all(g.dtype == torch.bfloat16 for g in grads)
    pairs = [("loss", got.loss, ref_low.loss, truth.loss)]
    pairs += [
        (n, a, r, t) for n, a, r, t in zip(("hidden", "weight", "bias"), grads, ref_grads, truth_grads, strict=True)
    ]
    for name, a, r, t in pairs:
        err = (a.double().cpu() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(2, 3, 8, 11, seed=23)
    hidden, weight, bias, ids, adv, mask, old = (t.to(device) for t in (hidden, weight, bias, ids, adv, mask, old))
    flat = hidden.reshape(6, 8).requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    options = LossOptions(old_logps=old, epsilon_high=0.2, importance_sampling_level="sequence",
                          max_completion_length=3)  # fmt: skip
    for logit_args in ((0.9, 1.0, 0.0), (0.9, 0.7, 2.5)):  # (temperature, logit_scale, logit_softcap)
        op_args = (flat, w, bias, ids.reshape(-1), adv, mask, *options.op_args(), *logit_args, 4, 0.0, None, 0)
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_hidden.default, op_args)

    def fn(h, weight):
        out = grpo_ext.grpo_loss_from_hidden(h, weight, ids, adv, mask, lm_head_bias=bias, old_logps=old,
                                             temperature=0.9, logit_scale=0.7, logit_softcap=2.5,
                                             chunk_size=4)  # fmt: skip
        return out.loss

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    expected = torch.autograd.grad(fn(hidden.requires_grad_(True), w), (hidden, w))
    value = compiled(hidden, w)
    grads = torch.autograd.grad(value, (hidden, w))
    assert_close(value, fn(hidden, w), rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, expected, strict=True):
        assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_errors():
    hidden, weight, bias, ids, adv, mask, *_ = make_problem(seed=24)
    with pytest.raises(ValueError, match="lm_head_weight must have shape"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight[:, :3], ids, adv, mask)
    with pytest.raises(ValueError, match="lm_head_weight must match"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight.float(), ids, adv, mask)
    with pytest.raises(ValueError, match="lm_head_bias"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, lm_head_bias=bias[:3])
    with pytest.raises(ValueError, match="chunk_size"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, chunk_size=0)
    with pytest.raises(ValueError, match="logit_scale must be finite and > 0"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, logit_scale=float("inf"))
    with pytest.raises(ValueError, match="logit_softcap must be finite and > 0"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, logit_softcap=-1.0)
    with pytest.raises(ValueError, match="completion_ids must have shape"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids[:, :2], adv, mask)
    with pytest.raises(ValueError, match=r"hidden must have shape \[B, T, H\] with \[B, T\]=\(4, 5\)"):
        grpo_ext.grpo_loss_from_hidden(hidden[:, :4], weight, ids, adv, mask)
    with pytest.raises(ValueError, match="token rows"):  # [N, H] rows: only their number can be checked
        grpo_ext.grpo_loss_from_hidden(hidden.reshape(-1, hidden.shape[-1])[:-1], weight, ids, adv, mask)


def test_reference_never_reads_masked_rows():
    """NaN hidden states in masked rows reach no gradient (0 * NaN in g.T @ hidden would): reference and kernel."""
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(seed=17)
    clean, clean_grads = run(reference, hidden, weight, bias, ids, adv, mask, old_logps=old)
    masked_nan = hidden.clone()
    masked_nan[~mask] = float("nan")
    for impl in (reference, grpo_ext):
        got, grads = run(impl, masked_nan, weight, bias, ids, adv, mask, old_logps=old)
        assert_close(got.loss, clean.loss, rtol=1e-12, atol=1e-12, msg=impl.__name__)
        for grad, expected in zip(grads, clean_grads, strict=True):
            assert torch.isfinite(grad).all(), impl.__name__
            assert_close(grad, expected, rtol=1e-10, atol=1e-12, msg=impl.__name__)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit_scale,logit_softcap", [(0.6, None), (1.0, 1.5), (1.7, 2.0)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logit_scale_and_softcap_match_reference(device, logit_scale, logit_softcap, level):
    """Cohere's scale and Gemma 2's soft-cap (docs/math.md section 2), gradients through the raw logits to hidden,
    weight and bias; float64, float32 and bf16 (error at most twice the reference's in bf16); the reference head."""
    hidden, weight, bias, ids, adv, mask, old, ref = make_problem(seed=31)
    hidden = 2.0 * hidden  # logits of a few units: the caps of 1.5-2 bend them
    g = torch.Generator().manual_seed(3)  # old and ref near the policy's own log-probs under these options
    own = reference.selective_log_softmax(hidden @ weight.t() + bias, ids, temperature=0.8, logit_scale=logit_scale,
                                          logit_softcap=logit_softcap).logps  # fmt: skip
    old = own + 0.25 * torch.randn(own.shape, generator=g, dtype=torch.float64)
    ref = own + 0.2 * torch.randn(own.shape, generator=g, dtype=torch.float64)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.05, importance_sampling_level=level, temperature=0.8,
                  logit_scale=logit_scale, logit_softcap=logit_softcap)  # fmt: skip
    expected, expected_grads = run(reference, hidden, weight, bias, ids, adv, mask, **kwargs)
    _, plain_grads = run(reference, hidden, weight, bias, ids, adv, mask,
                             **{**kwargs, "logit_scale": 1.0, "logit_softcap": None})  # fmt: skip
    assert (plain_grads[1] - expected_grads[1]).abs().max() > 1e-4  # the options matter here
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 3e-5)):
        got, grads = run(grpo_ext, hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype),
                         ids.to(device), adv.to(device, dtype), mask.to(device), chunk_size=3,
                         **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        for name, a, b in zip(("hidden", "weight", "bias"), grads, expected_grads, strict=True):
            assert_close(a, b, rtol=10 * tol, atol=tol, msg=f"grad {name} {dtype}")
        assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=tol, atol=tol, msg="entropy")
    low = [t.to(torch.bfloat16) for t in (hidden, weight, bias)]
    low_kwargs = cast_kwargs("cpu", torch.float32, kwargs)
    truth, truth_grads = run(reference, *[t.double() for t in low], ids, adv, mask, **kwargs)
    ref_low, ref_grads = run(reference, *low, ids, adv.float(), mask, **low_kwargs)
    got, grads = run(grpo_ext, *[t.to(device) for t in low], ids.to(device), adv.float().to(device),
                     mask.to(device), chunk_size=5, **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    for name, a, r, t in zip(("loss", "hidden", "weight", "bias"), [got.loss, *grads], [ref_low.loss, *ref_grads],
                             [truth.loss, *truth_grads], strict=True):  # fmt: skip
        err = (a.double().cpu() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)
    # the reference log-probs from a reference head go through the same options
    ref_weight = weight + 0.05
    ref_logps = reference.selective_log_softmax(
        hidden @ ref_weight.t() + bias, ids, temperature=0.8, logit_scale=logit_scale, logit_softcap=logit_softcap
    ).logps.detach()
    args = [t.to(device) for t in (hidden, weight, ids, adv, mask)]
    with_logps = hidden_loss(*args, lm_head_bias=bias.to(device),
                             **cast_kwargs(device, torch.float64, {**kwargs, "ref_logps": ref_logps}))  # fmt: skip
    policy_kwargs = cast_kwargs(device, torch.float64, {k: v for k, v in kwargs.items() if k != "ref_logps"})
    ref_head = (hidden.to(device), ref_weight.to(device), bias.to(device))
    with_head = hidden_loss(*args, lm_head_bias=bias.to(device), ref_head=ref_head, **policy_kwargs)
    assert_close(with_head.loss, with_logps.loss, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("level", ["token", "sequence"])  # sequence: the gradient comes from the second pass
@pytest.mark.parametrize("chunk_size", [3, None])
def test_masked_rows_get_zero_grad_hidden_with_a_non_finite_weight(device, bad, level, chunk_size):
    """A NaN/inf LM-head weight makes the loss NaN, but the masked rows (mask or sample_mask) are never used: their
    hidden-state gradient is exactly 0, as the reference's (``0 @ NaN`` in ``g @ W`` must not leak there)."""
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(seed=23)
    weight = weight.clone()
    weight[5, 3] = bad
    kwargs = dict(old_logps=old, importance_sampling_level=level, sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]))
    _, expected_grads = run(reference, hidden, weight, bias, ids, adv, mask, **kwargs)
    dropped = (~mask) | (kwargs["sample_mask"] == 0).unsqueeze(1)
    assert dropped.any() and (~dropped).any()
    assert (expected_grads[0][dropped] == 0).all() and expected_grads[0][~dropped].isnan().any()  # the bad weight bites
    for dtype in (torch.float64, torch.float32):
        got, grads = run(grpo_ext, hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype),
                         ids.to(device), adv.to(device, dtype), mask.to(device), chunk_size=chunk_size,
                         **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert got.loss.isnan()
        for name, a, b in zip(("hidden", "weight", "bias"), grads, expected_grads, strict=True):
            torch.testing.assert_close(a.double().cpu(), b, rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=f"grad {name} {dtype}")  # fmt: skip
    # torch.compile's composite op shares the chunked forward: its gradients too
    options = validate_grpo_loss_args(old, adv, mask, LossOptions(**kwargs))
    _, _, _, grad_hidden, grad_weight, grad_bias, *_ = torch.ops.grpo_ext.grpo_loss_from_hidden(
        hidden.flatten(0, 1), weight, bias, ids.flatten(), adv, mask, *options.op_args(), 1.0, 1.0, 0.0,
        chunk_size or hidden.shape[0] * hidden.shape[1], 0.0, None, 0,
    )  # fmt: skip
    for name, a, b in zip(("hidden", "weight", "bias"), (grad_hidden.view_as(hidden), grad_weight, grad_bias),
                          expected_grads, strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True, msg=f"composite op's grad {name}")


def call_hidden(grad: bool, args: tuple, options: dict, **extra):
    """``run`` with gradients, or the op under no_grad (no gradients)."""
    if grad:
        return run(grpo_ext, *args, **options, **extra)
    with torch.no_grad():
        hidden, weight, bias, *rest = args
        return grpo_ext.grpo_loss_from_hidden(hidden, weight, *rest, lm_head_bias=bias, **options, **extra), None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("grad", [True, False])
def test_return_token_logps(device, level, grad):
    """``return_token_logps=True``: the [B, T] log-probs and entropies the chunks' pass computed, equal to the float64
    selective_log_softmax of the materialized logits at the kept tokens and 0 at the others, detached; the loss and
    its gradients are the ones without it."""
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(seed=21)
    sample_mask = torch.tensor([True, False, True, True])
    kwargs = dict(old_logps=old, importance_sampling_level=level, temperature=0.8, logit_scale=1.2, logit_softcap=4.0,
                  sample_mask=sample_mask, chunk_size=3)  # fmt: skip
    expected = reference.selective_log_softmax(hidden @ weight.t() + bias, ids, temperature=0.8, logit_scale=1.2,
                                               logit_softcap=4.0, return_entropy=True)  # fmt: skip
    kept = mask & sample_mask.unsqueeze(1)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        args = (hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype), ids.to(device),
                adv.to(device, dtype), mask.to(device))  # fmt: skip
        options = cast_kwargs(device, dtype, kwargs)
        plain, plain_grads = call_hidden(grad, args, options)
        out, grads = call_hidden(grad, args, options, return_token_logps=True)
        assert isinstance(out, grpo_ext.GRPOLossTokenOutput)
        assert not out.token_logps.requires_grad and not out.token_entropy.requires_grad
        assert out.token_logps.shape == out.token_entropy.shape == mask.shape
        assert_close(out.token_logps, torch.where(kept, expected.logps, 0.0), rtol=tol, atol=tol, msg="logps")
        assert_close(out.token_entropy, torch.where(kept, expected.entropy, 0.0), rtol=tol, atol=tol, msg="entropy")
        assert_close(out.loss, plain.loss, rtol=0, atol=0)
        if grad:
            for a, b in zip(grads, plain_grads, strict=True):
                assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_return_token_logps_must_be_a_bool(bad):
    hidden, weight, _, ids, adv, mask, _, _ = make_problem()
    with pytest.raises(ValueError, match="return_token_logps"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, return_token_logps=bad)
