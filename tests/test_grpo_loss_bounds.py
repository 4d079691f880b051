"""grpo_ext.grpo_loss at the contract's bounds and ties (docs/math.md section 8, "Bounds and ties"): the
gradient at exact clamp bounds and clip ties, verl's KL estimators at their clamps and the float32 clip bound, each
against the reference and a float64 expectation. A ratio that overflows: tests/test_grpo_loss_overflow.py."""

from __future__ import annotations

import math

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close, cast_kwargs
from grpo_ext import reference
from grpo_ext.validation.options import CLIP_FAMILY_LOSS_TYPES, LOSS_TYPES
from grpo_ext.validation.options import IMPORTANCE_SAMPLING_LEVELS as LEVELS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ["abs", "k1+", "k3+", "low_var_kl"])
@pytest.mark.parametrize("kl_clamp", [None, 20.0])
def test_verl_kl_estimators_at_their_clamps(device, estimator, kl_clamp):
    """Log-ratios r = l_ref - l from -25 to 25 with 0 among them: the +-20 clamp, the cap at 10 and |r|'s kink act."""
    r = torch.tensor([[-25.0, -3.0, -0.5, 0.0, 0.5, 2.0, 3.0, 25.0]], dtype=torch.float64).repeat(2, 1)
    logps = -torch.rand(2, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) - 0.5
    ref_logps, adv, mask = logps + r, torch.tensor([0.5, -1.0], dtype=torch.float64), torch.ones(2, 8)
    results = []
    for impl, dev in ((grpo_ext, device), (reference, "cpu")):
        leaf = logps.to(dev).clone().requires_grad_(True)
        out = impl.grpo_loss(leaf, adv.to(dev), mask.to(dev), ref_logps=ref_logps.to(dev), beta=0.1,
                             kl_estimator=estimator, kl_clamp=kl_clamp, loss_type="dapo")  # fmt: skip
        out.loss.backward()
        results.append((out.loss, leaf.grad, out.metrics["kl"]))
    (loss, grad, kl), (want_loss, want_grad, want_kl) = results
    assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    assert_close(kl, want_kl, rtol=1e-12, atol=1e-12)
    if estimator.endswith("+"):  # straight-through: k2's gradient on the raw r, clamps or not
        assert_close(want_grad.cpu(), (-adv.unsqueeze(1) + 0.1 * -r) / 16, rtol=1e-12, atol=1e-12)


# Exact bounds and ties (docs/math.md section 8, "Bounds and ties"): ratios and KL log-ratios exactly on a clamp bound,
# where the gradient passes. Two rows of two equal tokens, full mask, advantages A = [1, -1/2]; a case gives the
# options, the log-ratio d = l - l_old (None: on-policy, rho = exp(0) = 1 exactly) and the expected dP/dl of a token
# in float64 as a function of A and rho. The cases on rho = 1 and on r = +-1/2 hold bf16 values, the others need an
# exp(d) that both the kernel (glibc) and the reference (torch) round alike, checked in the test (float64 only).
TIE_ADVANTAGES = [1.0, -0.5]
OFF_POLICY_RHO = {0.25: math.exp(0.25), -0.25: math.exp(-0.25)}
CLIP_TIES = {
    # on-policy rho = 1 on both clip bounds, on the upper one, on the lower one: the whole -A * rho, never half
    "epsilon_0": (dict(epsilon=0.0), None, lambda a, rho: -a * rho),
    "epsilon_high_0": (dict(epsilon_high=0.0), None, lambda a, rho: -a * rho),
    "epsilon_0_high_0.2": (dict(epsilon=0.0, epsilon_high=0.2), None, lambda a, rho: -a * rho),
    "upper_bound_off_policy": (dict(epsilon_high=OFF_POLICY_RHO[0.25] - 1), 0.25, lambda a, rho: -a * rho),
    "lower_bound_off_policy": (dict(epsilon=1 - OFF_POLICY_RHO[-0.25]), -0.25, lambda a, rho: -a * rho),
    # rho = delta above the clip range: A > 0 takes the clipped term (no gradient), A < 0 the delta-capped one
    "delta_above_clip_range": (
        dict(delta=OFF_POLICY_RHO[0.25], epsilon_high=0.2),
        0.25,
        lambda a, rho: -a * rho if a < 0 else 0.0,
    ),
    "delta_inside_clip_range": (dict(delta=OFF_POLICY_RHO[0.25], epsilon_high=0.5), 0.25, lambda a, rho: -a * rho),
}
# (estimator, bias correction) -> dKL/dl at r = l_ref - l on a kl_clamp bound (the unclamped derivative); on-policy
KL_TIE_GRADS = {
    ("k1", False): lambda r: 1.0,
    ("k2", False): lambda r: -r,
    ("k3", False): lambda r: 1 - math.exp(r),
    ("abs", False): lambda r: -math.copysign(1.0, r),
    ("low_var_kl", False): lambda r: 1 - math.exp(r),
    ("k3", True): lambda r: -r,  # rho * KL: dKL/dl + KL * drho/dl = (1 - e^r) + (e^r - r - 1)
}
# r where exp(r) - r - 1 is exactly low_var_kl's cap 10 in float64, both as torch and as glibc's expm1(r) - r give it
LOW_VAR_KL_CAP_TIE = -10.999983298020256


def tie_gradient_weight(loss_type: str, batch: int, length: int) -> float:
    """d loss / d P of one token of a full-mask batch (docs/math.md section 5)."""
    return 1.0 / batch if loss_type == "luspo" else 1.0 / (batch * length)


def assert_tie_gradients(loss_type, dtype, logps, kwargs, expected_token_grads) -> None:
    """The CPU kernel's and the reference's gradients agree with each other and with the float64 expectation."""
    adv = torch.tensor(TIE_ADVANTAGES, dtype=dtype)
    mask = torch.ones(logps.shape)
    grads, losses = [], []
    for impl in (grpo_ext, reference):
        leaf = logps.to(dtype).clone().requires_grad_(True)
        out = impl.grpo_loss(leaf, adv, mask, loss_type=loss_type, **cast_kwargs("cpu", dtype, kwargs))
        out.loss.backward()
        grads.append(leaf.grad)
        losses.append(out.loss)
    expected = torch.tensor(expected_token_grads, dtype=torch.float64) * tie_gradient_weight(loss_type, *logps.shape)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-3)
    assert_close(losses[0], losses[1], **tol, msg="loss")
    assert_close(grads[1], expected, **tol, msg="reference gradient")
    assert_close(grads[0], expected, **tol, msg="kernel gradient")
    assert_close(grads[0], grads[1], **tol, msg="kernel against reference")


TIE_DTYPES = {"float64": torch.float64, "bf16": torch.bfloat16}
# a ratio other than 1 sits exactly on a bound only where both exps round alike: float64
CLIP_TIE_CASES = [
    (case, dtype) for case in CLIP_TIES for dtype in TIE_DTYPES if CLIP_TIES[case][1] is None or dtype == "float64"
]
# the cap at 10 is hit exactly by low_var_kl in float64 only
KL_TIE_CASES = [
    (estimator, r, dtype) for estimator in KL_TIE_GRADS for r in ("upper_clamp", "lower_clamp") for dtype in TIE_DTYPES
]
KL_TIE_CASES.append((("low_var_kl", False), "low_var_kl_cap", "float64"))
KL_TIE_R = {"upper_clamp": 0.5, "lower_clamp": -0.5, "low_var_kl_cap": LOW_VAR_KL_CAP_TIE}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", CLIP_FAMILY_LOSS_TYPES)
@pytest.mark.parametrize(("case", "dtype_name"), CLIP_TIE_CASES, ids=[f"{c}-{d}" for c, d in CLIP_TIE_CASES])
def test_gradient_passes_at_exact_clip_and_delta_bounds(case, dtype_name, loss_type, level):
    options, log_ratio, token_grad = CLIP_TIES[case]
    dtype = TIE_DTYPES[dtype_name]
    logps = torch.full((2, 2), -1.0 if log_ratio is None else -1.0 + log_ratio, dtype=torch.float64)
    kwargs = dict(options, importance_sampling_level=level)
    rho = 1.0
    if log_ratio is not None:
        rho = OFF_POLICY_RHO[log_ratio]
        assert torch.exp(torch.tensor(log_ratio, dtype=torch.float64)).item() == rho, "torch's exp and glibc's differ"
        kwargs["old_logps"] = torch.full((2, 2), -1.0, dtype=torch.float64)
    expected = [[token_grad(a, rho)] * 2 for a in TIE_ADVANTAGES]
    assert_tie_gradients(loss_type, dtype, logps, kwargs, expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    ("estimator", "bound", "dtype_name"),
    KL_TIE_CASES,
    ids=[f"{e[0]}{'_bias' if e[1] else ''}-{b}-{d}" for e, b, d in KL_TIE_CASES],
)
def test_gradient_passes_at_exact_kl_clamp_bounds(estimator, bound, dtype_name, loss_type, level):
    """On-policy, so the policy term's gradient is -A for every loss type (sapo's sigmoid slope, vespo's phi and
    cispo's weight are all 1 at rho = 1); the KL term's passes at kl_clamp = 1/2 and at low_var_kl's cap."""
    kl_estimator, bias = estimator
    r, dtype = KL_TIE_R[bound], TIE_DTYPES[dtype_name]
    on_cap = bound == "low_var_kl_cap"
    logps = torch.full((2, 2), -1.0, dtype=torch.float64)
    ref_logps = logps + r
    assert (ref_logps - logps == r).all()
    if on_cap:
        assert (torch.exp(torch.tensor(r)) - r - 1).item() == 10.0 and math.expm1(r) - r == 10.0
    kwargs = dict(beta=1.0, ref_logps=ref_logps, kl_estimator=kl_estimator, kl_clamp=None if on_cap else 0.5,
                  use_bias_correction_kl=bias, importance_sampling_level=level)  # fmt: skip
    expected = [[-a + KL_TIE_GRADS[estimator](r)] * 2 for a in TIE_ADVANTAGES]
    assert_tie_gradients(loss_type, dtype, logps, kwargs, expected)


def test_float32_clip_bound_is_one_minus_epsilon_rounded_once():
    """The float32 kernel's clip bound is 1 - epsilon rounded once to float32, as the reference compares it: at
    epsilon = 0.058, float(1) - float(0.058) would be one step above it (0.94200003 against 0.942), so a ratio of
    exactly 0.942 was clipped (no gradient, a clip share of 1) where the contract keeps it (the gradient passes,
    share 0)."""
    eps = 0.058
    bound = torch.tensor(1 - eps, dtype=torch.float32)
    assert torch.tensor(1.0) - torch.tensor(eps) > bound  # the bound a float32 subtraction would give
    start = torch.tensor(math.log(1 - eps), dtype=torch.float32)
    steps = [start]
    for _ in range(20):  # the float32 log-probs just above log(0.942): one whose exp is exactly the bound
        steps.append(torch.nextafter(steps[-1], torch.tensor(0.0)))
    logp = next(x for x in steps if torch.exp(x) == bound)
    logps, adv, mask = torch.full((1, 2), logp.item()), torch.tensor([-1.0]), torch.ones(1, 2)
    kwargs = dict(old_logps=torch.zeros(1, 2), epsilon=eps, loss_type="bnpo")
    grads, outs = [], []
    for impl in (grpo_ext, reference):
        leaf = logps.clone().requires_grad_(True)
        out = impl.grpo_loss(leaf, adv, mask, **kwargs)
        out.loss.backward()
        grads.append(leaf.grad)
        outs.append(out)
    expected = torch.full((1, 2), 0.942 * 0.5, dtype=torch.float64)  # -A * rho / sum m: unclipped
    assert_close(grads[1], expected, rtol=1e-6, atol=1e-7, msg="reference gradient")
    assert_close(grads[0], expected, rtol=1e-6, atol=1e-7, msg="kernel gradient")
    assert outs[0].metrics["clip_ratio/low_mean"].item() == 0.0

