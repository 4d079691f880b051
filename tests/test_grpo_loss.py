"""grpo_ext.grpo_loss (the fused kernel) against the float64 reference: values, metrics and gradients."""

from __future__ import annotations

import collections
import itertools
import math
import zlib

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close, cast_kwargs, make_loss_batch
from grpo_ext import reference
from grpo_ext.validation.options import CLIP_FAMILY_LOSS_TYPES, LOSS_TYPES
from grpo_ext.validation.options import IMPORTANCE_SAMPLING_LEVELS as LEVELS

# (beta, kl_estimator, kl_clamp, use_bias_correction_kl)
KL_CONFIGS = {
    "no_kl": (0.0, "k3", None, False),
    "k1": (0.05, "k1", None, False),
    "k2": (0.05, "k2", None, False),
    "k3": (0.05, "k3", None, False),
    "k3_clamp": (0.3, "k3", 0.15, False),
    "k3_bias": (0.05, "k3", None, True),
    "k2_clamp_bias": (0.1, "k2", 0.1, True),
    "abs": (0.05, "abs", None, False),
    "k1+_clamp": (0.3, "k1+", 0.15, False),
    "k3+_bias": (0.05, "k3+", None, True),
    "low_var_kl_clamp": (0.1, "low_var_kl", 20.0, False),
}
EXTRAS = ["plain", "delta", "is_weights_sample_mask", "token_advantages", "denominators", "policy_weights"]


def run_both(batch, device: str, dtype: torch.dtype, **kwargs):
    """Runs the kernel on `device` in `dtype` and the reference in float64 on the CPU; returns both and grads."""
    dev = batch.to(device, dtype)
    logps = dev.logps.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, dev.advantages, dev.mask, **_tensors(dev, kwargs))
    out.loss.backward()
    ref64 = batch.to("cpu", torch.float64)
    ref_logps = ref64.logps.clone().requires_grad_(True)
    ref = reference.grpo_loss(ref_logps, ref64.advantages, ref64.mask, **_tensors(ref64, kwargs))
    ref.loss.backward()
    return out, logps.grad, ref, ref_logps.grad


def _tensors(batch, kwargs):
    """Replaces the placeholder strings in kwargs with the batch's tensors."""
    resolved = {}
    for key, value in kwargs.items():
        resolved[key] = getattr(batch, value) if isinstance(value, str) and hasattr(batch, value) else value
    return resolved


def case_kwargs(loss_type: str, level: str, kl: str, extra: str) -> dict:
    beta, estimator, clamp, bias = KL_CONFIGS[kl]
    kwargs = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        old_logps="old_logps",
        beta=beta,
        kl_estimator=estimator,
        kl_clamp=clamp,
        use_bias_correction_kl=bias,
    )
    if beta:
        kwargs["ref_logps"] = "ref_logps"
    if extra == "delta":
        kwargs["delta"] = 1.25
        kwargs["epsilon_high"] = 0.28
    elif extra == "is_weights_sample_mask":
        kwargs["is_weights"] = "is_weights"
        kwargs["sample_mask"] = "sample_mask"
    elif extra == "policy_weights":  # with is_weights: for vespo the two act on different things
        kwargs["is_weights"] = "is_weights"
        kwargs["policy_weights"] = "policy_weights"
    elif extra == "denominators":
        kwargs.update(max_completion_length=16, num_items_in_batch=37, loss_scale=0.25, epsilon=0.1,
                      skip_empty_rows=True)  # fmt: skip
    return kwargs


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("kl", list(KL_CONFIGS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference_cpu_float32(loss_type, level, kl, extra):
    seed = zlib.crc32(f"{loss_type}-{level}-{kl}-{extra}".encode()) % 1000
    batch = make_loss_batch(seed=seed, per_token_advantages=extra == "token_advantages")
    out, grad, ref, ref_grad = run_both(batch, "cpu", torch.float32, **case_kwargs(loss_type, level, kl, extra))
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6, msg="loss")
    assert out.metrics.keys() == ref.metrics.keys()
    for name in ref.metrics:
        assert_close(out.metrics[name], ref.metrics[name], rtol=1e-5, atol=1e-6, msg=name)
    assert grad.dtype == torch.float32
    assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6, msg="grad")


def float64_cases(loss_type: str, level: str) -> list[dict]:
    """The options of the float64 tests (here and tests/cuda_emu): clamped KL estimators, delta, every weight."""
    cases = []
    for kl in ("k3_clamp", "k2_clamp_bias"):
        kwargs = case_kwargs(loss_type, level, kl, "is_weights_sample_mask")
        kwargs["delta"] = 1.3
        cases.append(kwargs)
    return cases


FLOAT64_BATCH = dict(seed=3, batch=12, seq_len=17, group_size=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_float64_kernel_equals_reference_to_rounding(device, loss_type, level):
    """The float64 instantiation of the kernel computes the same function as the reference, to 1e-12."""
    batch = make_loss_batch(**FLOAT64_BATCH)
    for kwargs in float64_cases(loss_type, level):
        out, grad, ref, ref_grad = run_both(batch, device, torch.float64, **kwargs)
        assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
        assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        for name in ref.metrics:
            assert_close(out.metrics[name], ref.metrics[name], rtol=1e-12, atol=1e-12, msg=name)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log_ratio", [80.0, 88.5, 100.0])
@pytest.mark.parametrize("advantage", [-1.0, 1.0])
def test_float32_ratio_near_and_beyond_overflow_matches_reference(device, log_ratio, advantage):
    """A float32 ratio e^d near float32's largest value (e^88.72) is e^d rounded, and beyond it inf, as the
    reference's torch.exp gives it: loss, gradient (a clipped token's 0 * inf is NaN in both) and the k3 KL. The CPU
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


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_float32_matches_reference(device, loss_type, level):
    for kl, extra in itertools.product(KL_CONFIGS, EXTRAS):
        batch = make_loss_batch(seed=7, batch=16, seq_len=300, per_token_advantages=extra == "token_advantages")
        out, grad, ref, ref_grad = run_both(batch, device, torch.float32, **case_kwargs(loss_type, level, kl, extra))
        # atol 4e-6: float32's own floor on these rows (sums of hundreds): the CPU float32 kernel's loss errs by up to
        # 2.2e-6 on them (luspo, H100 machine, 2026-11-26); the accuracy rule is the 2x-CPU test below.
        assert_close(out.loss, ref.loss, rtol=1e-5, atol=4e-6, msg=f"{kl} {extra}")
        assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6, msg=f"{kl} {extra}")
        for name in ref.metrics:
            assert_close(out.metrics[name], ref.metrics[name], rtol=1e-5, atol=1e-6, msg=name)


# The float32 precision rule (below and tests/cuda_emu/test_loss.py): rows of 300 tokens whose partial sums are
# hundreds while luspo's batch total is 1e-3, so that a reduction rounding its row sums to float32 shows.
PRECISION_BATCH = dict(seed=7, batch=16, seq_len=300)
PRECISION_FLOOR = 1e-9  # per summed output: an error sum of 0 on the CPU must not demand 0 of the CUDA kernel


def float32_errors(loss: torch.Tensor, metrics: torch.Tensor, grad: torch.Tensor | None, truth: tuple) -> dict:
    """Absolute errors of a float32 kernel's outputs against float64 ones ``truth`` = (loss, metrics, grad): the
    loss', the metrics' summed, the gradient's largest."""
    errors = {
        "loss": (loss.double().cpu() - truth[0].cpu()).abs().item(),
        "metrics": (metrics.double().cpu() - truth[1].cpu()).abs().sum().item(),
    }
    if grad is not None:
        errors["grad"] = (grad.double().cpu() - truth[2].cpu()).abs().max().item()
    return errors


def assert_error_at_most_twice_cpu(kernel: dict, cpu: dict, what: str) -> None:
    """The CUDA kernel's float32 errors at most twice the CPU kernel's on the same inputs, each summed over the cases
    of one loss type and level (summed, because two float32 kernels that round alike still differ case by case by
    factors of 2 or 3 either way: which rows' sums round up is chance)."""
    for name, cpu_error in cpu.items():
        assert kernel[name] <= 2 * cpu_error + PRECISION_FLOOR, (
            f"{what} {name}: the CUDA kernel's error {kernel[name]:.3g}, the CPU kernel's {cpu_error:.3g}"
        )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_float32_error_at_most_twice_cpu_kernel(device, loss_type, level):
    """Every KL configuration and extra: the CUDA kernel in float32 is as accurate as the CPU kernel in float32
    (issue 31: luspo's sequence-level loss was 10x less accurate on an H100)."""
    totals = {device: collections.Counter(), "cpu": collections.Counter()}
    for kl, extra in itertools.product(KL_CONFIGS, EXTRAS):
        batch = make_loss_batch(**PRECISION_BATCH, per_token_advantages=extra == "token_advantages")
        kwargs = case_kwargs(loss_type, level, kl, extra)
        for dev in totals:
            out, grad, ref, ref_grad = run_both(batch, dev, torch.float32, **kwargs)
            stack = torch.stack([out.metrics[name] for name in ref.metrics])
            truth = (ref.loss.detach(), torch.stack([ref.metrics[name] for name in ref.metrics]).detach(), ref_grad)
            totals[dev].update(float32_errors(out.loss.detach(), stack.detach(), grad, truth))
    assert_error_at_most_twice_cpu(totals[device], totals["cpu"], f"{loss_type} {level}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("low_precision", [torch.bfloat16, torch.float16])
def test_low_precision_error_at_most_twice_reference(device, loss_type, low_precision):
    """flash-attention's rule: the kernel's error is at most twice that of the reference run in the same dtype."""
    batch = make_loss_batch(seed=11, batch=32, seq_len=257)
    kwargs = case_kwargs(loss_type, "token", "k3", "plain")
    low = batch.to("cpu", low_precision).to("cpu", torch.float64)  # the exact inputs the low-precision runs see
    truth, truth_grad = _reference_loss_and_grad(low, torch.float64, kwargs)
    ref_lp, ref_lp_grad = _reference_loss_and_grad(low, low_precision, kwargs)
    dev = low.to(device, low_precision)
    logps = dev.logps.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, dev.advantages, dev.mask, **_tensors(dev, kwargs))
    out.loss.backward()
    assert logps.grad.dtype == low_precision
    loss_err = (out.loss.double().cpu() - truth).abs().item()
    ref_loss_err = (ref_lp.double() - truth).abs().item()
    assert loss_err <= 2 * ref_loss_err + 1e-6
    grad_err = (logps.grad.double().cpu() - truth_grad).abs().max().item()
    ref_grad_err = (ref_lp_grad.double() - truth_grad).abs().max().item()
    assert grad_err <= 2 * ref_grad_err + 1e-7


def _reference_loss_and_grad(batch, dtype, kwargs):
    b = batch.to("cpu", dtype)
    logps = b.logps.clone().requires_grad_(True)
    out = reference.grpo_loss(logps, b.advantages, b.mask, **_tensors(b, kwargs))
    out.loss.backward()
    return out.loss.detach(), logps.grad


@pytest.mark.parametrize("device", DEVICES)
def test_masks_of_every_dtype_and_non_contiguous_inputs(device):
    batch = make_loss_batch(seed=5, batch=8, seq_len=20)
    kwargs = case_kwargs("grpo", "token", "k3", "is_weights_sample_mask")
    _, _, ref, ref_grad = run_both(batch, "cpu", torch.float64, **kwargs)
    for mask_dtype in (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16):
        dev = batch.to(device, torch.float32)
        dev.mask = dev.mask.to(mask_dtype)
        # every [B, T] input as a transposed view, the advantages as a strided slice
        for name in ("logps", "old_logps", "ref_logps", "is_weights", "mask"):
            setattr(dev, name, getattr(dev, name).t().contiguous().t())
        dev.advantages = torch.stack([dev.advantages, dev.advantages], 1)[:, 0]
        assert not dev.logps.is_contiguous() and not dev.advantages.is_contiguous()
        logps = dev.logps.detach().requires_grad_(True)
        out = grpo_ext.grpo_loss(logps, dev.advantages, dev.mask, **_tensors(dev, kwargs))
        out.loss.backward()
        assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6, msg=str(mask_dtype))
        assert_close(logps.grad, ref_grad, rtol=1e-4, atol=1e-6, msg=str(mask_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_masked_positions_never_leak(device):
    """Garbage (NaN, -inf) under the mask, in a sample-masked row included, changes nothing and gets no gradient."""
    batch = make_loss_batch(seed=9).to(device, torch.float32)
    kwargs = dict(old_logps=batch.old_logps, ref_logps=batch.ref_logps, beta=0.1, sample_mask=batch.sample_mask)
    clean = grpo_ext.grpo_loss(batch.logps, batch.advantages, batch.mask, **kwargs).loss
    dropped = ~(batch.mask & batch.sample_mask[:, None])
    dirty = batch.logps.masked_fill(dropped, float("nan")).requires_grad_(True)
    kwargs["old_logps"] = batch.old_logps.masked_fill(dropped, float("-inf"))
    kwargs["ref_logps"] = batch.ref_logps.masked_fill(dropped, float("inf"))
    out = grpo_ext.grpo_loss(dirty, batch.advantages, batch.mask, **kwargs)
    out.loss.backward()
    assert torch.equal(out.loss, clean)
    assert torch.isfinite(dirty.grad).all()
    assert (dirty.grad[dropped] == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_deterministic_bitwise(device, loss_type):
    batch = make_loss_batch(seed=13, batch=64, seq_len=513).to(device, torch.float32)
    results = []
    for _ in range(3):
        logps = batch.logps.clone().requires_grad_(True)
        out = grpo_ext.grpo_loss(
            logps, batch.advantages, batch.mask, old_logps=batch.old_logps, ref_logps=batch.ref_logps, beta=0.04,
            loss_type=loss_type, importance_sampling_level="sequence",
        )  # fmt: skip
        out.loss.backward()
        results.append((out.loss, logps.grad, torch.stack(list(out.metrics.values()))))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_num_items_in_batch_as_tensor(device):
    batch = make_loss_batch(seed=2).to(device, torch.float32)
    as_number = grpo_ext.grpo_loss(batch.logps, batch.advantages, batch.mask, loss_type="dapo", num_items_in_batch=23)
    for n in (torch.tensor(23.0, device=device), torch.tensor(23, device=device), torch.tensor([23.0])):
        as_tensor = grpo_ext.grpo_loss(batch.logps, batch.advantages, batch.mask, loss_type="dapo",
                                       num_items_in_batch=n.reshape(()) if n.dim() else n)  # fmt: skip
        assert_close(as_tensor.loss, as_number.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_mode_and_grad_scaling(device):
    batch = make_loss_batch(seed=4).to(device, torch.float32)
    with torch.no_grad():
        out = grpo_ext.grpo_loss(batch.logps, batch.advantages, batch.mask, old_logps=batch.old_logps)
    logps = batch.logps.clone().requires_grad_(True)
    out_grad = grpo_ext.grpo_loss(logps, batch.advantages, batch.mask, old_logps=batch.old_logps)
    assert torch.equal(out.loss, out_grad.loss.detach())
    (3.0 * out_grad.loss).backward()  # backward scales by the incoming gradient
    logps2 = batch.logps.clone().requires_grad_(True)
    grpo_ext.grpo_loss(logps2, batch.advantages, batch.mask, old_logps=batch.old_logps, loss_scale=3.0).loss.backward()
    assert_close(logps.grad, logps2.grad, rtol=1e-6, atol=1e-9)
    assert not any(v.requires_grad for v in out_grad.metrics.values())


def expected_nan_grad(bad: torch.Tensor, kept: torch.Tensor, level: str, loss_type: str, where: str) -> torch.Tensor:
    """Where a non-finite kept input must make the gradient NaN (docs/math.md "Non-finite inputs"): its own token,
    and at the sequence level every kept token of its row when the value reaches the row's ratio (through the
    log-ratio, or through the gradient with respect to the ratio, which cispo and vespo stop); with vespo, at either
    level, every kept token of its row when the value reaches the row's weight (l, l_old, is_weights)."""
    if loss_type == "vespo":
        return kept & bad.any(dim=1, keepdim=True) if where in ("logps", "old_logps", "is_weights") else bad
    reaches_ratio = where in ("logps", "old_logps") or loss_type != "cispo"
    if level == "sequence" and reaches_ratio:
        return kept & bad.any(dim=1, keepdim=True)
    return bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("value", [float("-inf"), float("inf"), float("nan")], ids=["-inf", "inf", "nan"])
@pytest.mark.parametrize(
    ("where", "on_policy"),
    [(name, False) for name in ("logps", "old_logps", "ref_logps", "advantages", "is_weights")]
    + [(name, True) for name in ("logps", "ref_logps", "advantages", "is_weights")],
)
def test_non_finite_kept_input_makes_the_loss_and_its_gradients_nan(device, level, loss_type, value, where, on_policy):
    """A non-finite kept input is NaN in the loss and in every gradient entry it reaches, kernel and reference alike:
    never an infinite loss or a huge finite gradient (an unmasked -inf log-prob with beta > 0 gave 1e36 before)."""
    batch = make_loss_batch(seed=21, batch=8, seq_len=5, per_token_advantages=where == "advantages")
    kept = batch.mask & batch.sample_mask[:, None]
    row, col = 2, int(kept[2].nonzero()[0])  # a kept token; other rows stay finite
    if where == "advantages":
        batch.advantages[row, col] = value
    else:
        getattr(batch, where)[row, col] = value
    kwargs = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, ref_logps="ref_logps",
                  is_weights="is_weights", sample_mask="sample_mask")  # fmt: skip
    if not on_policy:
        kwargs["old_logps"] = "old_logps"
    out, grad, ref, ref_grad = run_both(batch, device, torch.float32, **kwargs)
    bad = torch.zeros_like(kept)
    bad[row, col] = True
    nan_grad = expected_nan_grad(bad, kept, level, loss_type, where)
    assert torch.isnan(out.loss) and torch.isnan(ref.loss)
    assert torch.isnan(out.metrics["kl"]) and torch.isnan(ref.metrics["kl"])
    assert torch.equal(torch.isnan(ref_grad), nan_grad), "the reference"
    assert torch.equal(torch.isnan(grad.cpu()), nan_grad), "the kernel"
    assert (grad.cpu()[~kept] == 0).all()
    assert_close(grad[~nan_grad.to(device)], ref_grad[~nan_grad], rtol=1e-4, atol=1e-6)
    for name, value in ref.metrics.items():  # the clip shares skip the NaN ratio alike
        if name == "vespo/phi_seq_mean" and torch.isnan(value):  # the row's weight is NaN: so is the mean of phi
            assert torch.isnan(out.metrics[name])
        elif name != "kl":
            assert_close(out.metrics[name], value, rtol=1e-5, atol=1e-6, msg=name)
