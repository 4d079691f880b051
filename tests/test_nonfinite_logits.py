"""+-inf and NaN logits in a kept row (docs/math.md, "Non-finite inputs"): the rule applies to the logits the softmax
sees, after ``logit_scale`` and ``logit_softcap``. A capped +-inf is the finite ``+-logit_softcap``, as in the model's
own forward; a NaN stays NaN; without a cap +inf makes its row NaN."""

from __future__ import annotations

import math

import pytest
import torch

import grpo_ext
from conftest import assert_close
from grpo_ext import reference

SCALE, CAP, TEMPERATURE = 1.5, 4.0, 0.8


def make_logits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[2, 3, 11]`` float64 logits, their ids and a mask that keeps row ``[1, 1]`` (the one the tests poison)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(2, 3, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    ids[1, 1] = 4
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return logits, ids, mask


def poison(logits: torch.Tensor, value: float, positions: tuple[int, ...]) -> torch.Tensor:
    """``logits`` with ``value`` at the vocabulary ``positions`` of row ``[1, 1]``."""
    out = logits.clone()
    out[1, 1, list(positions)] = value
    return out


def capped(logits: torch.Tensor) -> torch.Tensor:
    """What the softmax sees before the temperature, in float64: ``CAP * tanh(SCALE * x / CAP)`` (+-inf -> +-CAP)."""
    return CAP * torch.tanh(SCALE * logits / CAP)


# +-inf at a token that is not chosen (4), at the chosen one, at both
POSITIONS = [(2,), (4,), (2, 4)]


def log_softmax_run(impl, logits: torch.Tensor, ids: torch.Tensor, **options):
    x = logits.detach().clone().requires_grad_(True)
    out = impl.selective_log_softmax(x, ids, temperature=TEMPERATURE, return_entropy=True, **options)
    out.logps.sum().add(out.entropy.sum()).backward()
    return out.logps.detach(), out.entropy.detach(), x.grad


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_selective_log_softmax_caps_infinite_logits(value, positions, dtype):
    logits, ids, _ = make_logits(seed=1)
    bad = poison(logits, value, positions)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    got = log_softmax_run(grpo_ext, bad.to(dtype), ids, logit_scale=SCALE, logit_softcap=CAP)
    # the oracle: the float64 reference on the capped values, which are finite (+-CAP at the poisoned entries)
    on_capped = capped(bad)
    assert torch.isfinite(on_capped).all() and (on_capped[1, 1, list(positions)] == math.copysign(CAP, value)).all()
    expected = log_softmax_run(reference, on_capped, ids)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    assert_close(got[0], expected[0], rtol=tol, atol=tol, msg="logps")
    assert_close(got[1], expected[1], rtol=tol, atol=tol, msg="entropy")
    # the gradient with respect to the raw logits: the reference with the same options; tanh is flat at +-inf
    ref_grad = log_softmax_run(reference, bad, ids, logit_scale=SCALE, logit_softcap=CAP)[2]
    assert_close(got[2], ref_grad, rtol=tol, atol=tol, msg="grad")
    assert (got[2][1, 1, list(positions)] == 0).all()


@pytest.mark.parametrize("cap", [CAP, None])
def test_selective_log_softmax_nan_logit_stays_nan_with_or_without_a_cap(cap):
    logits, ids, _ = make_logits(seed=2)
    bad = poison(logits, float("nan"), (2,))
    for impl in (grpo_ext, reference):
        logps, entropy, grad = log_softmax_run(impl, bad.float(), ids, logit_scale=SCALE, logit_softcap=cap)
        assert torch.isnan(logps[1, 1]) and torch.isnan(entropy[1, 1]) and torch.isnan(grad[1, 1]).all()
        others = torch.ones(2, 3, dtype=torch.bool)
        others[1, 1] = False
        assert torch.isfinite(logps[others]).all() and torch.isfinite(grad[others]).all()


def test_selective_log_softmax_infinite_logit_without_a_cap_is_nan():
    logits, ids, _ = make_logits(seed=3)
    bad = poison(logits, float("inf"), (2,))
    for impl in (grpo_ext, reference):
        logps, entropy, grad = log_softmax_run(impl, bad.float(), ids, logit_scale=SCALE)
        assert torch.isnan(logps[1, 1]) and torch.isnan(entropy[1, 1]) and torch.isnan(grad[1, 1]).all()


def loss_run(impl, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, **options):
    """grpo_loss_from_logits with an off-policy ratio (old log-probs of the clean logits) and a KL term."""
    x = logits.detach().clone().requires_grad_(True)
    adv = torch.tensor([0.7, -1.2], dtype=torch.float64)
    old = torch.full((2, 3), -2.3, dtype=torch.float64)
    out = impl.grpo_loss_from_logits(x, ids, adv.to(logits.dtype), mask, temperature=TEMPERATURE, old_logps=old,
                                     ref_logps=old - 0.1, beta=0.04, **options)  # fmt: skip
    out.loss.backward()
    return out.loss.detach(), out.metrics["entropy"], x.grad


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo_loss_from_logits_caps_infinite_logits(value, positions, level, dtype):
    logits, ids, mask = make_logits(seed=4)
    bad = poison(logits, value, positions)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    got = loss_run(grpo_ext, bad.to(dtype), ids, mask, logit_scale=SCALE, logit_softcap=CAP,
                   importance_sampling_level=level)  # fmt: skip
    expected = loss_run(reference, capped(bad), ids, mask, importance_sampling_level=level)  # the capped values
    assert torch.isfinite(got[0]) and torch.isfinite(got[1]) and torch.isfinite(got[2]).all()
    assert_close(got[0], expected[0], rtol=tol, atol=tol, msg="loss")
    assert_close(got[1], expected[1], rtol=tol, atol=tol, msg="entropy")
    ref_grad = loss_run(reference, bad, ids, mask, logit_scale=SCALE, logit_softcap=CAP,
                        importance_sampling_level=level)[2]  # fmt: skip
    assert_close(got[2], ref_grad, rtol=tol, atol=tol, msg="grad")


@pytest.mark.parametrize(("value", "cap"), [(float("nan"), CAP), (float("nan"), None), (float("inf"), None)])
def test_grpo_loss_from_logits_nan_logit_or_uncapped_inf_makes_the_loss_nan(value, cap):
    logits, ids, mask = make_logits(seed=5)
    bad = poison(logits, value, (2,))
    for impl in (grpo_ext, reference):
        loss, entropy, grad = loss_run(impl, bad.float(), ids, mask, logit_scale=SCALE, logit_softcap=cap)
        assert torch.isnan(loss) and torch.isnan(entropy), impl.__name__
        assert torch.isnan(grad[1, 1]).all(), impl.__name__


def weighted_loss_run(impl, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, way: str, **options):
    """grpo_loss_from_logits without a KL term, the kept token ``[1, 1]`` weighted 0 in the loss by ``way``: its
    policy weight, its importance weight or its advantage (per token), and its entropy-bonus weight."""
    x = logits.detach().clone().requires_grad_(True)
    dtype = logits.dtype
    adv = torch.tensor([[0.7, -0.4, 0.3], [-1.2, 0.9, 0.5]], dtype=dtype)
    weights = torch.ones(2, 3, dtype=dtype)
    weights[1, 1] = 0.0
    if way == "advantage":
        adv[1, 1] = 0.0
    kwargs = {way: weights} if way != "advantage" else {}
    out = impl.grpo_loss_from_logits(x, ids, adv, mask, temperature=TEMPERATURE, entropy_coef=0.3,
                                     entropy_weights=weights, old_logps=torch.full((2, 3), -2.3, dtype=dtype),
                                     **kwargs, **options)  # fmt: skip
    out.loss.backward()
    return out.loss.detach(), x.grad


ZERO_WEIGHT_WAYS = ["policy_weights", "is_weights", "advantage"]


@pytest.mark.parametrize("way", ZERO_WEIGHT_WAYS)
@pytest.mark.parametrize(("value", "positions", "cap"), [(float("-inf"), (2,), None), (float("-inf"), (2, 4), CAP),
                                                         (float("inf"), (2, 4), CAP)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo_loss_from_logits_zero_weight_token_gets_exactly_zero_gradient(way, value, positions, cap, dtype):
    # A kept token weighted 0 whose logits hold what the softmax sees as finite or -inf (a -inf that is not the
    # chosen token, a capped +-inf): its log-prob is finite, and with nothing upstream its gradient is exactly 0.
    logits, ids, mask = make_logits(seed=6)
    bad = poison(logits, value, positions)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    loss, grad = weighted_loss_run(grpo_ext, bad.to(dtype), ids, mask, way, logit_scale=SCALE, logit_softcap=cap)
    ref_loss, ref_grad = weighted_loss_run(reference, bad, ids, mask, way, logit_scale=SCALE, logit_softcap=cap)
    assert torch.isfinite(ref_loss) and torch.equal(ref_grad[1, 1], torch.zeros(11, dtype=torch.float64))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[1, 1], torch.zeros(11, dtype=dtype))
    assert_close(loss, ref_loss, rtol=tol, atol=tol, msg="loss")
    assert_close(grad, ref_grad, rtol=tol, atol=tol, msg="grad")


#: A NaN logit (capped or not), an uncapped +inf, an uncapped -inf at the chosen token (4): a non-finite log-prob.
NON_FINITE_LOG_PROB = [(float("nan"), (2,), CAP), (float("nan"), (4,), None), (float("inf"), (2,), None),
                       (float("-inf"), (4,), None)]  # fmt: skip


@pytest.mark.parametrize("way", ZERO_WEIGHT_WAYS)
@pytest.mark.parametrize(("value", "positions", "cap"), NON_FINITE_LOG_PROB)
def test_grpo_loss_from_logits_zero_weight_does_not_hide_a_non_finite_log_prob(way, value, positions, cap):
    # A weight of 0 does not mask a token out: a kept token whose log-prob is NaN or -inf (a NaN logit, an uncapped
    # +inf, a chosen token at -inf) is the caller's error, and the loss and that row's gradient stay NaN
    # (docs/math.md, "Non-finite inputs"), in the reference too.
    logits, ids, mask = make_logits(seed=7)
    bad = poison(logits, value, positions)
    for impl in (grpo_ext, reference):
        loss, grad = weighted_loss_run(impl, bad.float(), ids, mask, way, logit_scale=SCALE, logit_softcap=cap)
        assert torch.isnan(loss), impl.__name__
        assert torch.isnan(grad[1, 1]).all(), impl.__name__


@pytest.mark.parametrize("way", ZERO_WEIGHT_WAYS)
@pytest.mark.parametrize("cap", [None, CAP])
def test_grpo_loss_from_hidden_zero_weight_token_with_banned_vocabulary_entries(way, cap):
    # Through the LM head: a bias of -inf bans vocabulary entries (logits -inf in every row); the kept token [1, 1]
    # weighted 0 gets an exactly zero hidden-state gradient, and the weight and bias gradients are the reference's.
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64)
    bias = torch.randn(11, generator=g, dtype=torch.float64)
    bias[[2, 7]] = float("-inf")
    _, ids, mask = make_logits(seed=8)
    ids[ids == 2] = 3  # the sampled tokens are not banned
    ids[ids == 7] = 3
    adv = torch.tensor([[0.7, -0.4, 0.3], [-1.2, 0.9, 0.5]], dtype=torch.float64)
    weights = torch.ones(2, 3, dtype=torch.float64)
    weights[1, 1] = 0.0
    if way == "advantage":
        adv[1, 1] = 0.0
    kwargs = {way: weights} if way != "advantage" else {}

    def run(impl, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = impl.grpo_loss_from_hidden(leaves[0], leaves[1], ids, adv.to(dtype), mask, lm_head_bias=leaves[2],
                                         temperature=TEMPERATURE, logit_scale=SCALE, logit_softcap=cap,
                                         entropy_coef=0.3, entropy_weights=weights.to(dtype),
                                         old_logps=torch.full((2, 3), -2.3, dtype=dtype),
                                         **{k: v.to(dtype) for k, v in kwargs.items()})  # fmt: skip
        out.loss.backward()
        return (out.loss.detach(), *(t.grad for t in leaves))

    expected = run(reference, torch.float64)
    assert torch.equal(expected[1][1, 1], torch.zeros(5, dtype=torch.float64))
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got = run(grpo_ext, dtype)
        assert all(torch.isfinite(t).all() for t in got), dtype
        assert torch.equal(got[1][1, 1], torch.zeros(5, dtype=dtype)), dtype
        for name, a, b in zip(("loss", "hidden", "weight", "bias"), got, expected, strict=True):
            assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} {dtype}")
