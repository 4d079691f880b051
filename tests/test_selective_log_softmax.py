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


def test_issue_31_zero_upstream_row_with_minus_inf_target_gets_zero_gradient():
    # issue 31, item 5: a token sampled under another policy has logit -inf here; weighting its row out must not
    # leave a NaN in the gradient
    logits, ids = make_logits(3, 7, seed=31)
    logits[1, ids[1]] = float("-inf")
    weights = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    x = logits.float().requires_grad_(True)
    (grpo_ext.selective_log_softmax(x, ids).logps * weights.float()).sum().backward()
    y = logits.clone().requires_grad_(True)
    (reference.selective_log_softmax(y, ids).logps * weights).sum().backward()
    assert torch.equal(y.grad[1], torch.zeros(7, dtype=torch.float64))
    assert torch.equal(x.grad[1], torch.zeros(7))
    assert_close(x.grad, y.grad, rtol=2e-5, atol=2e-5)


#: (row, vocabulary entries, value) written into the logits of ZERO_UPSTREAM_ROWS' test: every kind of non-finite
#: logit, at the chosen token (the row's id is set to entry 3) and elsewhere.
POISONED_ROWS = [
    (0, (3,), float("-inf")),
    (1, (0, 5), float("-inf")),
    (2, (3,), float("nan")),
    (3, (5,), float("nan")),
    (4, (3,), float("inf")),
    (5, (0,), float("inf")),
    (6, (3, 5), float("inf")),
]


def poisoned_logits(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[9, vocab]`` logits whose rows 0-6 hold POISONED_ROWS (rows 7 and 8 are finite), and their ids (no
    confident token: only the non-finite entries are under test)."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(9, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (9,), generator=g)
    for row, entries, value in POISONED_ROWS:
        ids[row] = 3
        logits[row, list(entries)] = value
    return logits, ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit_scale,logit_softcap", [(1.0, None), *LOGIT_OPTION_CASES])
@pytest.mark.parametrize("entropy_grad", ["none", "zero", "nonzero"])
def test_zero_upstream_rows_get_exactly_zero_gradient_whatever_their_logits(device, logit_scale, logit_softcap,
                                                                            entropy_grad):  # fmt: skip
    # docs/math.md, "Non-finite inputs": a row whose upstream gradients (of its log-prob and of its entropy) are both
    # exactly 0 gets an exactly zero gradient, whatever its logits hold; the other rows are the reference's.
    logits, ids = poisoned_logits(11, seed=17)
    g = torch.Generator().manual_seed(3)
    grad_logps = torch.randn(9, generator=g, dtype=torch.float64)
    grad_logps[:7] = 0.0
    grad_logps[2] = -0.0
    grad_entropy = torch.randn(9, generator=g, dtype=torch.float64)
    grad_entropy[:7] = 0.0
    if entropy_grad == "nonzero":  # rows 0 and 1 (-inf only) get an entropy gradient: finite, the reference's
        grad_entropy[:2] = torch.tensor([0.7, -1.3], dtype=torch.float64)
    weights = (grad_logps, grad_entropy if entropy_grad != "none" else None)
    options = dict(temperature=0.8, logit_scale=logit_scale, logit_softcap=logit_softcap,
                   return_entropy=entropy_grad != "none")  # fmt: skip

    def grad_of(impl, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        out = impl.selective_log_softmax(x, ids.to(x.device), **options)
        total = (out.logps * weights[0].to(x.device, out.logps.dtype)).sum()
        if weights[1] is not None:
            total = total + (out.entropy * weights[1].to(x.device, out.entropy.dtype)).sum()
        total.backward()
        return x.grad

    expected = grad_of(reference, logits)
    inert = slice(2 if entropy_grad == "nonzero" else 0, 7)
    assert torch.equal(expected[inert], torch.zeros_like(expected[inert]))
    assert (expected[7:] != 0).any()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        got = grad_of(grpo_ext, logits.to(device, dtype)).cpu()
        assert torch.isfinite(got).all(), dtype
        assert torch.equal(got[inert], torch.zeros_like(got[inert])), dtype
        assert_close(got, expected, rtol=tol, atol=tol, msg=str(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit_scale,logit_softcap", [(1.0, None), (1.7, 2.5)])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_minus_inf_chosen_logit_gets_the_one_hot_gradient(device, logit_scale, logit_softcap, return_entropy):
    # A chosen token the model cannot emit (its logit is -inf, p = 0): log-prob -inf, and d logp / dz = 1 - p = 1 at
    # that entry, not 0 * inf; with the entropy's gradient too (p * z -> 0 at z = -inf).
    logits, ids = make_logits(4, 13, seed=23)
    logits[[1, 2], ids[[1, 2]]] = float("-inf")
    logits[2, (ids[2] + 1) % 13] = float("-inf")
    g = torch.Generator().manual_seed(5)
    weights = (torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64))
    options = dict(logit_scale=logit_scale, logit_softcap=logit_softcap)
    if return_entropy:
        expected = run(logits, ids, reference, 0.9, weights, **options)
    else:
        x = logits.clone().requires_grad_(True)
        (reference.selective_log_softmax(x, ids, temperature=0.9, **options).logps * weights[0]).sum().backward()
        expected = (None, None, x.grad)
    assert torch.isfinite(expected[2]).all()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        if return_entropy:
            got = run(logits.to(device, dtype), ids.to(device), grpo_ext, 0.9, tuple(w.to(device) for w in weights),
                      **options)  # fmt: skip
            assert_close(got[1], expected[1], rtol=tol, atol=tol, msg="entropy")
        else:
            x = logits.to(device, dtype).clone().requires_grad_(True)
            out = grpo_ext.selective_log_softmax(x, ids.to(device), temperature=0.9, **options)
            (out.logps * weights[0].to(device, out.logps.dtype)).sum().backward()
            got = (out.logps.detach(), None, x.grad)
        if logit_softcap is None:
            assert torch.equal(got[0][[1, 2]].cpu(), torch.full((2,), float("-inf"), dtype=got[0].dtype))
        assert_close(got[2], expected[2], rtol=tol, atol=tol, msg=f"grad {dtype}")


def _errors(impl, logits: torch.Tensor, ids: torch.Tensor, truth: tuple, **options) -> list[float]:
    """Max errors of impl's log-probs, entropy and gradient (of logps + 0.3 * entropy) against float64 ``truth``."""
    x = logits.clone().requires_grad_(True)
    out = impl.selective_log_softmax(x, ids, return_entropy=True, **options)
    (out.logps.sum() + 0.3 * out.entropy.sum()).backward()
    got = (out.logps, out.entropy, x.grad)
    return [(a.detach().cpu().double() - b).abs().max().item() for a, b in zip(got, truth, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4, 1e6])
@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_large_logits_keep_their_precision(device, offset, temperature):
    """A softmax does not change when a row's logits all move by one amount, and the kernels' error must not grow
    with it either: at most twice the float32 reference's (the flash-attention rule), at offsets up to 1e6 and at a
    small temperature (z = x / 0.05). An outside audit, 2026-11-29: the backward took z - lse with lse rounded to
    float32, an error of an ulp of |z| (2e-4 at 1e4, 0.14 at 1e7)."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(6, 300, generator=gen) * 2
    logits = (offset + base) if temperature == 1.0 else (offset * temperature + base * temperature)
    ids = torch.randint(0, 300, (6,), generator=gen)
    x64 = logits.double().requires_grad_(True)
    truth = reference.selective_log_softmax(x64, ids, return_entropy=True, temperature=temperature)
    (truth.logps.sum() + 0.3 * truth.entropy.sum()).backward()
    truth = (truth.logps.detach(), truth.entropy.detach(), x64.grad)
    reference_error = _errors(reference, logits, ids, truth, temperature=temperature)
    kernel_error = _errors(grpo_ext, logits.to(device), ids.to(device), truth, temperature=temperature)
    for name, kernel, ref in zip(("logps", "entropy", "grad"), kernel_error, reference_error, strict=True):
        assert kernel <= 2 * ref + 1e-7, (name, kernel, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
def test_large_logits_keep_the_entropy_bonus_gradient_precise(device, offset):
    """The fused loss's entropy bonus gradient, p_v (z_v - E_p[z]), at large offsets: within twice the float32
    reference's error (an outside audit, 2026-11-29: E_p[z] rounded to float32 cost 2.5e-5 at 1e4, 2.5e-2 at 1e7)."""
    gen = torch.Generator().manual_seed(22)
    logits = offset + torch.randn(2, 3, 200, generator=gen) * 2
    ids, adv, mask = torch.randint(0, 200, (2, 3), generator=gen), torch.tensor([1.0, -1.0]), torch.ones(2, 3)

    def grad_of(impl, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        impl.grpo_loss_from_logits(x, ids.to(x.device), adv.to(x.device), mask.to(x.device),
                                   entropy_coef=0.5).loss.backward()  # fmt: skip
        return x.grad.cpu().double()

    truth = grad_of(reference, logits.double())
    reference_error = (grad_of(reference, logits) - truth).abs().max().item()
    kernel_error = (grad_of(grpo_ext, logits.to(device)) - truth).abs().max().item()
    assert kernel_error <= 2 * reference_error + 1e-8, (kernel_error, reference_error)
