"""grpo_ext.selective_log_softmax (docs/math.md section 2) against the materialized float64 log_softmax reference."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference


def make_logits(rows: int, vocab: int, *, seed: int = 0, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    if rows > 1:
        logits[1, ids[1]] += 40.0  # a confident token: p -> 1, where 1 - p would cancel
    return logits, ids


def run(logits: torch.Tensor, ids: torch.Tensor, impl, temperature: float, weights: tuple[torch.Tensor, torch.Tensor],
        **logit_options):  # fmt: skip
    x = logits.clone().requires_grad_(True)
    out = impl.selective_log_softmax(x, ids, temperature=temperature, return_entropy=True, **logit_options)
    (out.logps * weights[0]).sum().add((out.entropy * weights[1]).sum()).backward()
    return out.logps.detach(), out.entropy.detach(), x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 7, 300, 50257])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(device, vocab, temperature):
    rows = 6 if vocab < 10000 else 3
    logits, ids = make_logits(rows, vocab, seed=vocab)
    g = torch.Generator().manual_seed(1)
    weights = (torch.randn(rows, generator=g, dtype=torch.float64), torch.randn(rows, generator=g, dtype=torch.float64))
    ref = run(logits, ids, reference, temperature, weights)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        got = run(logits.to(device, dtype), ids.to(device), grpo_ext, temperature, tuple(w.to(device) for w in weights))
        assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert got[2].dtype == dtype
        for name, a, b in zip(("logps", "entropy", "grad"), got, ref, strict=True):
            assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("low_precision", [torch.bfloat16, torch.float16])
def test_low_precision_error_at_most_twice_reference(device, low_precision):
    logits, ids = make_logits(8, 4099, seed=3)
    low = logits.to(low_precision)
    weights = (torch.ones(8, dtype=torch.float64), 0.5 * torch.ones(8, dtype=torch.float64))
    truth = run(low.double(), ids, reference, 0.9, weights)
    ref_low = run(low, ids, reference, 0.9, weights)
    got = run(low.to(device), ids.to(device), grpo_ext, 0.9, tuple(w.to(device) for w in weights))
    for name, a, r, t in zip(("logps", "entropy", "grad"), got, ref_low, truth, strict=True):
        err = (a.double().cpu() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, (name, err, ref_err)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_shape_non_contiguous_and_infinite_logits(device):
    logits, ids = make_logits(12, 33, seed=5)
    logits[2, :5] = float("-inf")  # masked vocabulary entries (not the chosen one)
    ids[2] = 10
    wide = torch.zeros(12, 66, dtype=torch.float64)
    wide[:, ::2] = logits
    view = wide[:, ::2].reshape(3, 4, 33)  # strided rows, [B, T, V]
    assert not view.is_contiguous()
    expected = reference.selective_log_softmax(logits, ids, return_entropy=True)
    got = grpo_ext.selective_log_softmax(view.to(device), ids.reshape(3, 4).to(device), return_entropy=True)
    assert got.logps.shape == (3, 4)
    assert_close(got.logps.reshape(-1), expected.logps, rtol=1e-12, atol=1e-12)
    assert_close(got.entropy.reshape(-1), expected.entropy, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_confident_tokens_keep_relative_precision_at_large_logits(device):
    # Logits near 30 and tokens with p -> 1: log p down to ~-4e-6, entropy down to ~1e-4. Computing z_id - lse with
    # lse rounded to float (ulp(30) ~ 4e-6), or the entropy from sum p * z, would lose most of both (errors of tens
    # of percent); relative to the max the error is float32's own, as torch.log_softmax's in float32. The rule: the
    # largest relative error at most twice that of torch in float32 (the bf16 rule of flash-attention, in fp32).
    g = torch.Generator().manual_seed(4)
    vocab = 1000
    logits = 30.0 + 0.5 * torch.randn(8, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (8,), generator=g)
    logits[torch.arange(8), ids] += torch.linspace(14.0, 20.0, 8, dtype=torch.float64)
    expected = reference.selective_log_softmax(logits, ids, return_entropy=True)
    assert expected.logps.abs().max() < 3e-3 and expected.entropy.max() < 3e-2  # confident, as intended
    torch_logp = torch.log_softmax(logits.float(), -1)
    torch_out = (torch_logp.gather(-1, ids[:, None])[:, 0], -(torch_logp.exp() * torch_logp).sum(-1))
    got = grpo_ext.selective_log_softmax(logits.float().to(device), ids.to(device), return_entropy=True)
    for name, ours, theirs, truth in zip(
        ("logps", "entropy"), (got.logps, got.entropy), torch_out, (expected.logps, expected.entropy), strict=True
    ):
        err = ((ours.double().cpu() - truth) / truth).abs().max().item()
        torch_err = ((theirs.double() - truth) / truth).abs().max().item()
        assert err <= 2 * torch_err, (name, err, torch_err)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_logit_makes_its_row_nan_like_torch(device):
    logits, ids = make_logits(4, 37, seed=8)
    logits[2, 5] = float("nan")  # not the row's first entry, which a NaN-skipping max would catch anyway
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    assert torch.isnan(expected[2]) and torch.isfinite(expected[[0, 1, 3]]).all()
    x = logits.float().to(device).requires_grad_(True)
    got = grpo_ext.selective_log_softmax(x, ids.to(device), return_entropy=True)
    assert torch.isnan(got.logps[2]) and torch.isnan(got.entropy[2])
    assert_close(got.logps[[0, 1, 3]].double(), expected[[0, 1, 3]], rtol=2e-5, atol=2e-5)
    got.logps.sum().backward()
    assert torch.isnan(x.grad[2]).all() and torch.isfinite(x.grad[[0, 1, 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    logits, ids = make_logits(16, 5000, seed=7)
    x = logits.float().to(device)
    runs = [grpo_ext.selective_log_softmax(x, ids.to(device), return_entropy=True) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.logps, runs[0].logps) and torch.equal(r.entropy, runs[0].entropy)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gradcheck_compile(device):
    logits, ids = make_logits(4, 9, seed=2)
    x = logits.to(device).requires_grad_(True)
    ids = ids.to(device)
    for entropy in (False, True):
        for logit_args in ((0.8, 1.0, 0.0), (0.8, 0.7, 2.5)):  # (temperature, logit_scale, logit_softcap)
            args = (x, ids, *logit_args, entropy)
            torch.library.opcheck(torch.ops.grpo_ext.selective_log_softmax_forward.default, args)
    grad = torch.randn(4, dtype=torch.float64, device=device)
    for logit_args in ((0.8, 1.0, 0.0), (0.8, 0.7, 2.5)):
        stats = torch.ops.grpo_ext.selective_log_softmax_forward(x.detach(), ids, *logit_args, True)[2]
        torch.library.opcheck(
            torch.ops.grpo_ext.selective_log_softmax_backward.default,
            (grad, grad, x.detach(), ids, stats, *logit_args),
        )

    def fn(t):
        out = grpo_ext.selective_log_softmax(t, ids, temperature=0.8, return_entropy=True)
        return out.logps.sum() + 0.5 * out.entropy.sum()

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert_close(compiled(x), fn(x), rtol=1e-12, atol=1e-12)


def test_errors():
    logits = torch.randn(4, 5)
    for impl in (grpo_ext, reference):
        with pytest.raises(ValueError, match="ids must have shape"):
            impl.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match="temperature"):
            impl.selective_log_softmax(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
        with pytest.raises(ValueError, match="logits must be a floating-point tensor"):
            impl.selective_log_softmax(logits.long(), torch.zeros(4, dtype=torch.long))
        for bad in (0.0, -1.0, float("inf"), float("nan"), "2"):
            with pytest.raises(ValueError, match="logit_scale must be"):
                impl.selective_log_softmax(logits, torch.zeros(4, dtype=torch.long), logit_scale=bad)
            with pytest.raises(ValueError, match="logit_softcap must be"):
                impl.selective_log_softmax(logits, torch.zeros(4, dtype=torch.long), logit_softcap=bad)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        grpo_ext.selective_log_softmax(logits, torch.tensor([0, 1, 5, 2]))


#: (logit_scale, logit_softcap) cases beyond the default: the scale alone, the cap alone, both (docs/math.md 2).
LOGIT_OPTION_CASES = [(0.6, None), (1.0, 4.0), (1.7, 2.5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit_scale,logit_softcap", LOGIT_OPTION_CASES)
@pytest.mark.parametrize("vocab", [7, 4099])
def test_logit_scale_and_softcap_match_reference(device, logit_scale, logit_softcap, vocab):
    # Logits of scale 3 plus a confident token at +40: the cap (2.5-4) saturates there, where dz/dx -> 0.
    logits, ids = make_logits(6, vocab, seed=vocab + 11)
    g = torch.Generator().manual_seed(2)
    weights = (torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64))
    options = dict(logit_scale=logit_scale, logit_softcap=logit_softcap)
    truth = run(logits, ids, reference, 0.8, weights, **options)
    # the options change the result: a kernel that ignored them would fail
    plain = run(logits, ids, reference, 0.8, weights)
    assert (plain[0] - truth[0]).abs().max() > 1e-3 and (plain[2] - truth[2]).abs().max() > 1e-3
    dev_weights = tuple(w.to(device) for w in weights)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        got = run(logits.to(device, dtype), ids.to(device), grpo_ext, 0.8, dev_weights, **options)
        assert got[2].dtype == dtype
        for name, a, b in zip(("logps", "entropy", "grad"), got, truth, strict=True):
            assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} {dtype}")
    for low_precision in (torch.bfloat16, torch.float16):  # error at most twice the reference's in that dtype
        low = logits.to(low_precision)
        low_truth = run(low.double(), ids, reference, 0.8, weights, **options)
        ref_low = run(low, ids, reference, 0.8, weights, **options)
        got = run(low.to(device), ids.to(device), grpo_ext, 0.8, dev_weights, **options)
        for name, a, r, t in zip(("logps", "entropy", "grad"), got, ref_low, low_truth, strict=True):
            err = (a.double().cpu() - t).abs().max().item()
            ref_err = (r.double() - t).abs().max().item()
            assert err <= 2 * ref_err + 1e-6, (name, low_precision, err, ref_err)
