"""grpo_ext.grpo_loss where the ratio rho = exp(l - l_old) overflows (docs/math.md section 8, "An overflowing
ratio"): the loss and the gradient at the limit of a large finite rho, never NaN where the float64 reference is finite,
and the bias-corrected KL's factors of rho summed before the product (its k3 gradient in closed form), at the token
and the sequence level and through the fused logits pass."""

from __future__ import annotations

import math

import pytest
import torch

import grpo_ext
from conftest import DEVICES, cast_kwargs
from grpo_ext import reference
from grpo_ext.validation.options import IMPORTANCE_SAMPLING_LEVELS as LEVELS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log_ratio", [80.0, 88.5, 100.0])
@pytest.mark.parametrize("advantage", [-1.0, 1.0])
def test_float32_ratio_near_and_beyond_overflow_matches_reference(device, log_ratio, advantage):
    """A float32 ratio e^d near float32's largest value (e^88.72) is e^d rounded, and beyond it inf, as the
    reference's torch.exp gives it: loss, gradient (a clipped token's is 0 in both, section 8, "An overflowing
    ratio"; the KL's is -inf beyond) and the k3 KL. The CPU
    token loop's exp once clamped d to 88 (an outside audit, 2026-11-28: e^88.5 came out 1.65e38, not 2.72e38, and
    e^100 finite). One token, so that no float32 sum in the reference overflows first (the kernels sum in float64)."""
    logps, adv, mask = torch.full((1, 1), -1.0), torch.full((1,), advantage), torch.ones(1, 1)
    kwargs = dict(old_logps=logps - log_ratio, ref_logps=logps + log_ratio, beta=0.5, loss_type="bnpo")
    results = []
    for impl, on in ((grpo_ext, device), (reference, "cpu")):
        leaf = logps.to(on).requires_grad_(True)
        out = impl.grpo_loss(leaf, adv.to(on), mask.to(on), **cast_kwargs(on, torch.float32, kwargs))
        out.loss.backward()
        results.append((out.loss, out.metrics["kl"], leaf.grad))
    for got, want, name in zip(results[0], results[1], ("loss", "kl", "grad"), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0, equal_nan=True, msg=name)
    assert torch.isinf(results[0][1]).item() == (log_ratio > 88.72)  # the KL's e^d: finite below, inf above


# Ratios beyond the dtype's exp range (docs/math.md section 8, "An overflowing ratio"). Three rows of three tokens
# with A = [1, 0, -1]; token 0 of every row has d = l - l_old = OVERFLOW_LOG_RATIO[dtype] (for a sequence-level row
# the row's mean d is a third of it, still beyond the range), the others +-0.1. float32: e^300 and e^100 are finite
# in float64, so the float64 reference is the limit the contract asks for, rounded once; float64: d = 3000
# overflows in the reference too, whose ratio_exp states the rule.
OVERFLOW_LOG_RATIO = {torch.float32: 300.0, torch.float64: 3000.0}


def kernel_and_float64_reference(device, dtype, logps, adv, mask, kwargs) -> tuple:
    """``(kernel output, its gradient, reference output, its gradient in dtype)``: the kernel on ``device`` in
    ``dtype``, the reference on the float64 inputs."""
    leaf = logps.to(device, dtype, copy=True).requires_grad_(True)
    out = grpo_ext.grpo_loss(leaf, adv.to(device, dtype), mask.to(device), **cast_kwargs(device, dtype, kwargs))
    out.loss.backward()
    truth_leaf = logps.clone().requires_grad_(True)
    truth = reference.grpo_loss(truth_leaf, adv, mask, **kwargs)
    truth.loss.backward()
    return out, leaf.grad.cpu(), truth, truth_leaf.grad.to(dtype)


OVERFLOW_CASES = {
    "clip": dict(loss_type="dapo"),
    "clip_delta": dict(loss_type="dapo", delta=2.0),
    "sapo": dict(loss_type="sapo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo"),
    "vespo": dict(loss_type="vespo"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_overflowing_ratio_gives_the_limit_not_nan(device, case, dtype):
    """Where the gradient reaching an overflowed rho is exactly 0 (A > 0 clipped, capped by delta or saturating
    sapo's gate; A = 0; cispo's and vespo's stop-gradient weights) no 0 * inf = NaN reaches the token's gradient;
    A = 0 scores 0; an unclipped A < 0 gives +inf, as its value is. Before, every such token's gradient was NaN in
    the kernels and the reference alike."""
    log_ratio = OVERFLOW_LOG_RATIO[dtype]
    d = torch.tensor([[log_ratio, 0.1, -0.1]], dtype=torch.float64).repeat(3, 1)
    logps = torch.full((3, 3), -1.0, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64), torch.ones(3, 3)
    kwargs = dict(OVERFLOW_CASES[case], old_logps=logps - d)
    out, grad, truth, want = kernel_and_float64_reference(device, dtype, logps, adv, mask, kwargs)
    assert not grad.isnan().any() and not out.loss.isnan().item(), grad
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss.cpu(), truth.loss.to(dtype), rtol=1e-5, atol=1e-7)
    assert (grad[1] == 0).all()  # A = 0: no gradient, the overflowed token's included
    if case not in ("cispo", "vespo"):  # their weights are stop-gradient: -min(rho, 5) * A and -phi * A, finite
        assert grad[0, 0].item() == 0.0  # A > 0 with rho overflowed: clipped, capped or saturated
    if case in ("clip", "gspo"):  # A < 0 unclipped: +inf, at the token, or at the sequence level the whole row
        assert torch.isinf(grad[2, 0]).item() and math.isinf(out.loss.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ["k3", "k2", "k1", "abs", "low_var_kl", "k3+", "k1+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bias_corrected_kl_at_an_overflowed_ratio_gives_the_limit(device, estimator, dtype):
    """rho * KL where rho overflowed, at the limit of a large finite rho: 0 where KL is exactly 0 (l_ref == l), and
    rho times a KL gradient that is exactly 0 (r = 0; a KL clamp that cut it) is 0, not 0 * inf = NaN (an outside
    audit, 2026-11-29: NaN in the loss at l_ref == l, NaN in the gradient past a clamp). Where both of the KL term's
    gradients are infinite (k1+ and k3+ past the clamp: k2's gradient on the raw r is not cut), their sum's sign
    decides: -inf at l < l_ref, not inf - inf = NaN (the kernels' last NaN here, 2026-11-29)."""
    log_ratio = OVERFLOW_LOG_RATIO[dtype]
    # token 0: l_ref == l; token 1: l_ref = l + 1, past kl_clamp 0.2; token 2: an ordinary one
    d = torch.tensor([[log_ratio, log_ratio, 0.1]], dtype=torch.float64)
    logps = torch.tensor([[-1.0, -2.0, -1.5]], dtype=torch.float64)
    kwargs = dict(old_logps=logps - d, ref_logps=logps + torch.tensor([[0.0, 1.0, 0.1]], dtype=torch.float64),
                  beta=0.1, use_bias_correction_kl=True, kl_estimator=estimator, kl_clamp=0.2, loss_type="dapo")
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3)  # A > 0: the overflowed ratios clipped
    out, grad, truth, want = kernel_and_float64_reference(device, dtype, logps, adv, mask, kwargs)
    assert not grad.isnan().any() and not out.loss.isnan().item(), grad
    # a float64 reference of float32 inputs holds rho = e^300 finite, so it gives the limit everywhere; at d = 3000
    # its own ratio overflows and its two autograd paths meet as inf - inf at k1+'s and k3+'s token 1 (section 8)
    compared = [0, 2] if dtype == torch.float64 and estimator.endswith("+") else [0, 1, 2]
    torch.testing.assert_close(grad[:, compared], want[:, compared], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss.cpu(), truth.loss.to(dtype), rtol=1e-5, atol=1e-7)
    if estimator.endswith("+"):  # beta * rho * (KL + dKL/dl) with dKL/dl = -r_raw = -1 and KL <= 0.03
        assert grad[0, 1].item() == -math.inf
    if estimator not in ("k1", "k1+", "k3+"):  # k1's gradient is 1, the straight-through ones' r_raw (0 here)
        assert grad[0, 0].item() == 0.0  # KL = 0 and its gradient 0 at r = 0; the ratio's clipped
    assert math.isinf(out.loss.item())  # KL != 0 times an overflowed ratio


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kl_gap", [2.0, 5.0, 20.0])
def test_bias_corrected_kl_and_an_unclipped_ratio_overflowing_together_give_the_signed_limit(device, kl_gap):
    """A < 0 unclipped (the policy's gradient through rho is -A * rho = +inf) beside the bias-corrected k3 term
    (beta * rho * (l - l_ref) = -inf at l < l_ref): the limit is rho times the sum of their factors, 1 - 0.1 * gap,
    so +inf at a gap of 2 and 5, -inf at 20; before, inf - inf = NaN. float32 against the float64 reference, whose
    rho = e^300 is finite."""
    logps = torch.full((1, 1), -1.0, dtype=torch.float64)
    kwargs = dict(old_logps=logps - 300.0, ref_logps=logps + kl_gap, beta=0.1, use_bias_correction_kl=True,
                  loss_type="bnpo")  # fmt: skip
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1)
    out, grad, truth, want = kernel_and_float64_reference(device, torch.float32, logps, adv, mask, kwargs)
    assert grad.item() == (math.inf if kl_gap < 10 else -math.inf), grad
    assert torch.equal(grad, want)
    assert out.loss.item() == truth.loss.to(torch.float32).item() == math.inf


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kl_gap", [1.0, 10.0, 20.0, 30.0, 60.0])
def test_bias_corrected_k3_gradient_keeps_its_precision_far_from_the_reference(device, dtype, kl_gap):
    """The bias-corrected k3 term's gradient is beta * rho * (l - l_ref) in closed form (docs/math.md section 8):
    formed as rho * (exp(r) - r - 1) plus rho * (1 - exp(r)) it cancels to rounding noise once exp(r) outgrows r
    by the dtype's precision (float32: -4.0 for -3.32 at r = 20, 0 for -4.42 at r = 30; an outside check,
    2026-11-29). Against that closed form in float64, at l_ref - l up to 60."""
    logps = torch.tensor([[-30.0, -20.0, -45.0]], dtype=torch.float64)
    d = torch.tensor([[0.1, -0.05, 0.02]], dtype=torch.float64)
    adv, mask, beta = torch.tensor([0.5], dtype=torch.float64), torch.ones(1, 3), 0.1
    kwargs = dict(old_logps=logps - d, ref_logps=logps + kl_gap, beta=beta, use_bias_correction_kl=True,
                  loss_type="bnpo")  # fmt: skip
    leaf = logps.to(device, dtype, copy=True).requires_grad_(True)
    out = grpo_ext.grpo_loss(leaf, adv.to(device, dtype), mask.to(device), **cast_kwargs(device, dtype, kwargs))
    out.loss.backward()
    rho = d.exp()  # every ratio inside [0.8, 1.2]: the policy term's gradient is -A * rho
    want = (-adv * rho + beta * rho * -kl_gap) / 3
    torch.testing.assert_close(leaf.grad.cpu().double(), want, rtol=2e-6 if dtype == torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bias_corrected_k3_gradient_from_logits_keeps_its_precision(device, dtype):
    """The same closed form through the fused logits pass (its own token loop, shared with the hidden-state pass):
    dL/dz = dL/dl * (onehot - softmax), dL/dl = (-A * rho + beta * rho * (l - l_ref)) / n at l_ref - l = 30."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 11, generator=gen, dtype=torch.float64) * 3).to(dtype).double()  # exact in dtype
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    d = torch.tensor([[0.1, -0.05, 0.02], [0.0, 0.15, -0.1]], dtype=torch.float64)
    adv, mask, beta = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.ones(2, 3), 0.1
    kwargs = dict(old_logps=logps - d, ref_logps=logps + 30.0, beta=beta, use_bias_correction_kl=True,
                  loss_type="bnpo")  # fmt: skip
    leaf = logits.to(device, dtype).requires_grad_(True)
    out = grpo_ext.grpo_loss_from_logits(leaf, ids.to(device), adv.to(device), mask.to(device),
                                         **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    out.loss.backward()
    rho = d.exp()  # every ratio inside [0.8, 1.2]
    dloss_dl = (-adv.unsqueeze(1) * rho + beta * rho * -30.0) / 6
    probs = torch.softmax(logits, dim=-1)
    want = dloss_dl.unsqueeze(-1) * (torch.nn.functional.one_hot(ids, 11).double() - probs)
    tolerance = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(leaf.grad.cpu().double(), want, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("estimator", "mean_log_ratio"), [("k3", 100.0), ("k2", 100.0), ("low_var_kl", 100.0),
                                                          ("k3", 80.0)])  # fmt: skip
def test_sequence_level_bias_corrected_kl_at_an_overflowed_ratio_gives_the_signed_limit(
    device, estimator, mean_log_ratio
):
    """GSPO with the bias-corrected KL: a token's gradient is rho_i * (m / n * sum_s w_s dP_s/drho + w * beta *
    dKL/dl) plus the paths without rho, its own KL path and the row's ratio path as one factor of the row's ratio
    (docs/math.md section 8). Where rho_i * each part overflows float32 (rho_i = e^100 itself; at e^80 the products
    with KL ~ e^15) they met as inf - inf = NaN (docs/math.md named it, 2026-11-29); now the sum's sign decides. float32
    against the float64 reference, where rho_i and the products are finite, rounded to float32 once: +-inf by the
    factor's sign, or the finite value."""
    # three tokens a row, d = 3 * mean, 0.1, -0.1; l_ref - l of 2, 5 and 0 (k3's factor: the row's KL over n^2
    # against each token's own slope / n, of either sign); A > 0 clipped, A < 0 unclipped, A = 0
    d = torch.tensor([[3 * mean_log_ratio, 0.1, -0.1]], dtype=torch.float64).repeat(3, 1)
    gap = torch.tensor([[2.0, 5.0, 0.0], [15.0, 0.5, 1.0], [3.0, 3.0, 10.0]], dtype=torch.float64)
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64).repeat(3, 1)
    adv, mask = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64), torch.ones(3, 3)
    kwargs = dict(old_logps=logps - d, ref_logps=logps + gap, beta=0.1, use_bias_correction_kl=True,
                  kl_estimator=estimator, loss_type="grpo", importance_sampling_level="sequence")  # fmt: skip
    out, grad, truth, want = kernel_and_float64_reference(device, torch.float32, logps, adv, mask, kwargs)
    assert not grad.isnan().any(), grad
    assert torch.isinf(grad).sum() >= 3, grad  # the case under test: products beyond float32
    assert torch.equal(torch.isinf(grad), torch.isinf(want)) and torch.equal(grad.sign(), want.sign()), (grad, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(grad[finite], want[finite], rtol=1e-5, atol=1e-7)
    assert out.loss.item() == truth.loss.to(torch.float32).item() == math.inf


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_level_bias_corrected_kl_in_float64_beyond_its_range_gives_the_signed_limit(device):
    """The same in float64 at a row's mean log-ratio of 1000 (rho_i = inf there; the reference's autograd gives NaN,
    section 8): each token's gradient is +-inf by the sign of its factor of rho_i, which does not depend on rho_i
    once every ratio is clipped or unclipped for good, so the reference at a mean of 100 (finite) gives the signs."""
    gap = torch.tensor([[2.0, 5.0, 0.0], [15.0, 0.5, 1.0]], dtype=torch.float64)
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64).repeat(2, 1)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    signs = []
    for mean_log_ratio, on in ((1000.0, device), (100.0, "cpu")):
        d = torch.tensor([[3 * mean_log_ratio, 0.1, -0.1]], dtype=torch.float64).repeat(2, 1)
        kwargs = dict(old_logps=logps - d, ref_logps=logps + gap, beta=0.1, use_bias_correction_kl=True,
                      loss_type="grpo", importance_sampling_level="sequence")  # fmt: skip
        impl = grpo_ext if on == device else reference
        leaf = logps.to(on, copy=True).requires_grad_(True)
        out = impl.grpo_loss(leaf, adv.to(on), mask.to(on), **cast_kwargs(on, torch.float64, kwargs))
        out.loss.backward()
        signs.append(leaf.grad.cpu())
    got, finite_reference = signs
    assert not got.isnan().any(), got
    assert torch.equal(got, finite_reference.sign() * math.inf), (got, finite_reference)


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_level_bias_corrected_kl_from_logits_at_an_overflowed_ratio(device):
    """The same through the fused logits pass, whose sequence level takes d loss / d logp from grpo_loss' kernel
    before its second pass: dL/dz = dL/dl * (onehot - softmax), each entry +-inf by the sign of dL/dl (from the
    float64 reference of log-probs, where rho_i = e^100 is finite) times that of onehot - softmax; no NaN."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64).float().double()  # exact in float32
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    d = torch.tensor([[300.0, 0.1, -0.1], [240.0, 0.1, -0.1]], dtype=torch.float64)
    gap = torch.tensor([[2.0, 5.0, 0.0], [15.0, 0.5, 1.0]], dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    kwargs = dict(old_logps=logps - d, ref_logps=logps + gap, beta=0.1, use_bias_correction_kl=True,
                  importance_sampling_level="sequence")  # fmt: skip
    leaf = logits.to(device, torch.float32).requires_grad_(True)
    out = grpo_ext.grpo_loss_from_logits(leaf, ids.to(device), adv.to(device), mask.to(device),
                                         **cast_kwargs(device, torch.float32, kwargs))  # fmt: skip
    out.loss.backward()
    truth_leaf = logps.clone().requires_grad_(True)
    reference.grpo_loss(truth_leaf, adv, mask, **kwargs).loss.backward()
    onehot_minus_p = torch.nn.functional.one_hot(ids, 11).double() - torch.softmax(logits, dim=-1)
    want = truth_leaf.grad.sign().unsqueeze(-1) * onehot_minus_p.sign() * math.inf
    assert torch.equal(leaf.grad.cpu().double(), want), leaf.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("estimator", ["k1", "k1+"])
@pytest.mark.parametrize("kl_gap", [5.0, -5.0, 0.5])
def test_loss_at_an_overflowed_ratio_sums_its_factors_of_rho(device, level, estimator, kl_gap):
    """An unclipped A < 0 (policy term -A * rho = +inf) beside the bias-corrected KL of an estimator that can be
    negative (k1's -r: rho * KL = -inf at l_ref - l = 5): the loss is rho times the sum of the factors, -A + beta * KL
    (docs/math.md section 8), here 1 - 5 < 0: -inf, not inf - inf = NaN (found by a fuzz of the options against the
    reference, 2026-11-29). One token, so that no sum of two tokens' infinities (an indeterminate form) enters;
    float32 against the float64 reference, whose rho = e^300 is finite."""
    logps = torch.full((1, 1), -1.0, dtype=torch.float64)
    kwargs = dict(old_logps=logps - 300.0, ref_logps=logps + kl_gap, beta=1.0, use_bias_correction_kl=True,
                  kl_estimator=estimator, loss_type="bnpo", importance_sampling_level=level)  # fmt: skip
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1)
    out, grad, truth, want = kernel_and_float64_reference(device, torch.float32, logps, adv, mask, kwargs)
    assert out.loss.item() == truth.loss.to(torch.float32).item() == (-math.inf if kl_gap > 1 else math.inf)
    assert torch.equal(grad, want), (grad, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("weights", ["is_weights", "policy_weights"])
def test_a_zero_weight_at_an_overflowed_ratio_scores_zero(device, level, weights):
    """A token whose importance-sampling or policy weight is exactly 0 scores 0 and gets no policy gradient, whatever
    its ratio: at an overflowed rho with A < 0 unclipped its term was rho * -A * 0 = inf * 0 = NaN in the loss (the
    gradient's factor, -A * 0, was already 0). float32 against the float64 reference (rho = e^300 finite there)."""
    logps = torch.full((1, 2), -1.0, dtype=torch.float64)
    kwargs = dict(old_logps=logps - torch.tensor([[300.0, 0.1]], dtype=torch.float64), loss_type="dapo",
                  importance_sampling_level=level)  # fmt: skip
    kwargs[weights] = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2)
    out, grad, truth, want = kernel_and_float64_reference(device, torch.float32, logps, adv, mask, kwargs)
    assert not out.loss.isnan().item() and not grad.isnan().any(), (out.loss, grad)
    if level == "token":  # the weighted token's own ratio: a finite loss, e^0.1 * 1 / 2
        torch.testing.assert_close(out.loss.cpu(), truth.loss.to(torch.float32), rtol=1e-6, atol=0)
        assert grad[0, 0].item() == 0.0
    else:  # the row's ratio e^150.05 overflows: the other token's term is +inf
        assert out.loss.item() == truth.loss.to(torch.float32).item() == math.inf
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kl_gap", [1.0, 20.0, 30.0, 60.0])
def test_sequence_level_row_of_one_kept_token_keeps_k3_exact(device, dtype, kl_gap):
    """At the sequence level a row whose only kept token holds its count has that token's ratio, and its
    bias-corrected k3 gradient is the token level's closed form, beta * rho * (l - l_ref) (docs/math.md section 8):
    formed as the row's ratio path (rho * KL) plus the token's own path (rho * dKL/dl) it cancelled to noise, 0 at
    l_ref - l = 30 in float32 (found by the property test of one token at an overflowed ratio, 2026-11-29). Two rows,
    each with one kept token of three."""
    logps = torch.tensor([[-30.0, -2.0, -3.0], [-1.0, -45.0, -2.5]], dtype=torch.float64)
    d = torch.tensor([[0.1, 5.0, -5.0], [7.0, -0.05, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    adv, beta = torch.tensor([0.5, -1.0], dtype=torch.float64), 0.1
    kwargs = dict(old_logps=logps - d, ref_logps=logps + kl_gap, beta=beta, use_bias_correction_kl=True,
                  loss_type="bnpo", importance_sampling_level="sequence")  # fmt: skip
    leaf = logps.to(device, dtype, copy=True).requires_grad_(True)
    out = grpo_ext.grpo_loss(leaf, adv.to(device, dtype), mask.to(device), **cast_kwargs(device, dtype, kwargs))
    out.loss.backward()
    rho = d.exp()  # the kept tokens' ratios (e^0.1, e^-0.05) inside the clip range: the policy's gradient is -A * rho
    want = mask.double() * (-adv.unsqueeze(1) * rho + beta * rho * -kl_gap) / 2
    torch.testing.assert_close(leaf.grad.cpu().double(), want, rtol=2e-6 if dtype == torch.float32 else 1e-12, atol=0)
