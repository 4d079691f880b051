"""Spec section 8's properties, shown on the kernels, and hypothesis-generated batches against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grpo_ext
from conftest import DEVICES, assert_close, examples, make_loss_batch
from grpo_ext import reference
from grpo_ext.validation.options import LOSS_TYPES


def _policy_equals_reference(device: str, seed: int = 0):
    batch = make_loss_batch(seed=seed, batch=12, seq_len=11, group_size=4).to(device, torch.float32)
    batch.mask[0, 0] = True  # every row has at least one token
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(seed)).to(device)
    adv = grpo_ext.group_advantages(rewards, 4).advantages
    return batch, adv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [0.0, 0.04, 1.0])
def test_loss_starts_at_zero_but_gradient_does_not(device, beta):
    batch, adv = _policy_equals_reference(device)
    logps = batch.logps.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, adv, batch.mask, ref_logps=batch.logps, beta=beta)
    out.loss.backward()
    assert abs(out.loss.item()) < 1e-6
    m = batch.mask.double()
    n = m.sum(1, keepdim=True)
    expected = -adv.double()[:, None] * m / (n * m.shape[0])
    assert_close(logps.grad, expected, rtol=1e-5, atol=1e-7)
    assert logps.grad.abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_token_level_start_is_length_weighted(device, loss_type):
    batch, adv = _policy_equals_reference(device, seed=1)
    out = grpo_ext.grpo_loss(batch.logps, adv, batch.mask, loss_type=loss_type)
    n = batch.mask.double().sum(1)
    expected = -(n * adv.double()).sum() / n.sum()
    assert_close(out.loss, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_on_policy_kl_gradient(device, bias_correction):
    batch = make_loss_batch(seed=6).to(device, torch.float32)
    beta = 0.5
    zero_adv = torch.zeros_like(batch.advantages)
    logps = batch.logps.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, zero_adv, batch.mask, ref_logps=batch.ref_logps, beta=beta, loss_type="dapo",
                             use_bias_correction_kl=bias_correction)  # fmt: skip
    out.loss.backward()
    m = batch.mask.double()
    logp, l_ref = batch.logps.double(), batch.ref_logps.double()
    per_token = (logp - l_ref) if bias_correction else (1 - torch.exp(l_ref - logp))
    expected = beta * per_token * m / m.sum()
    assert_close(logps.grad, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_std_groups_masked_in_training(device):
    """Section 6: masking zero-std groups removes their KL pull and their tokens from every denominator."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2], device=device)
    adv = grpo_ext.group_advantages(rewards, 4)
    batch = make_loss_batch(seed=8, batch=8).to(device, torch.float32)
    keep = ~adv.zero_std.repeat_interleave(4)
    logps = batch.logps.clone().requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, adv.advantages, batch.mask, ref_logps=batch.ref_logps, beta=0.1,
                             sample_mask=keep, loss_type="dapo")  # fmt: skip
    out.loss.backward()
    assert (logps.grad[:4] == 0).all()
    sub = grpo_ext.grpo_loss(batch.logps[4:], adv.advantages[4:], batch.mask[4:], ref_logps=batch.ref_logps[4:],
                             beta=0.1, loss_type="dapo")  # fmt: skip
    assert_close(out.loss, sub.loss, rtol=1e-6, atol=1e-7)




@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_groups=st.integers(1, 5),
    group_size=st.integers(1, 6),
    seq_len=st.integers(1, 40),
    density=st.floats(0.0, 1.0),
    loss_type=st.sampled_from(LOSS_TYPES),
    level=st.sampled_from(["token", "sequence"]),
    beta=st.sampled_from([0.0, 0.04]),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
    spread=st.floats(0.0, 1.0),
    scale=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_reference(
    num_groups, group_size, seq_len, density, loss_type, level, beta, estimator, spread, scale, seed
):
    g = torch.Generator().manual_seed(seed)
    batch = num_groups * group_size
    logps = -torch.rand(batch, seq_len, generator=g, dtype=torch.float64) * 4
    old = logps + spread * torch.randn(batch, seq_len, generator=g, dtype=torch.float64)
    ref = logps + spread * torch.randn(batch, seq_len, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, seq_len, generator=g) < density
    rewards = torch.randn(batch, generator=g, dtype=torch.float64) * 10**scale
    adv = reference.group_advantages(rewards, group_size).advantages
    kwargs = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, kl_estimator=estimator)
    expected_l = logps.clone().requires_grad_(True)
    expected = reference.grpo_loss(expected_l, adv, mask, old_logps=old, ref_logps=ref, **kwargs)
    expected.loss.backward()
    got_l = logps.clone().requires_grad_(True)
    got = grpo_ext.grpo_loss(got_l, adv, mask, old_logps=old, ref_logps=ref, **kwargs)
    got.loss.backward()
    assert_close(got.loss, expected.loss, rtol=1e-10, atol=1e-12)
    assert_close(got_l.grad, expected_l.grad, rtol=1e-9, atol=1e-12)
    for name, value in expected.metrics.items():
        assert_close(got.metrics[name], value, rtol=1e-10, atol=1e-12, msg=name)


@st.composite
def loss_problems(draw, *, seq_len_max: int = 12) -> tuple:
    """A random float64 ``[B, T]`` problem and a random draw of every loss option (docs/math.md sections 3-7):
    ``(logps, advantages, completion_mask, options)``, ``logps`` the log-probs the old and reference ones lie near."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    batch, seq_len = draw(st.integers(1, 6)), draw(st.integers(1, seq_len_max))
    logps = -torch.rand(batch, seq_len, generator=g, dtype=torch.float64) * 4
    spread = draw(st.floats(0.0, 1.0))

    def near() -> torch.Tensor:
        return logps + spread * torch.randn(batch, seq_len, generator=g, dtype=torch.float64)

    mask = torch.rand(batch, seq_len, generator=g) < draw(st.floats(0.0, 1.0))
    if draw(st.booleans()):  # a float mask of weights (docs/math.md, "Masks")
        mask = mask * torch.rand(batch, seq_len, generator=g, dtype=torch.float64)
    per_token = draw(st.booleans())
    advantages = torch.randn(*((batch, seq_len) if per_token else (batch,)), generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        advantages[torch.rand(advantages.shape, generator=g) < 0.3] = 0.0  # zero-std groups, ties at rho = 1
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    beta = draw(st.sampled_from([0.0, 0.04, 0.5]))
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        old_logps=near() if draw(st.booleans()) else None,
        ref_logps=near() if beta != 0.0 or draw(st.booleans()) else None,
        beta=beta,
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
        kl_clamp=draw(st.sampled_from([None, 0.5, 10.0])),
        use_bias_correction_kl=draw(st.booleans()),
        epsilon=draw(st.sampled_from([0.0, 0.2])),
        epsilon_high=draw(st.sampled_from([None, 0.0, 0.28, 3.0])),
        delta=draw(st.sampled_from([None, 1.5, 4.0])),
        is_weights=0.5 + torch.rand(batch, seq_len, generator=g, dtype=torch.float64) if draw(st.booleans()) else None,
        policy_weights=torch.rand(batch, generator=g, dtype=torch.float64) if draw(st.booleans()) else None,
        sample_mask=torch.rand(batch, generator=g) < 0.8 if draw(st.booleans()) else None,
        skip_empty_rows=draw(st.booleans()),
        max_completion_length=draw(st.sampled_from([None, seq_len + 3])),
        num_items_in_batch=draw(st.sampled_from([None, 7.0])),
        loss_scale=draw(st.sampled_from([1.0, 0.25, -2.0])),
        sapo_temperature_pos=draw(st.sampled_from([1.0, 0.5])),
        sapo_temperature_neg=draw(st.sampled_from([1.05, 2.0])),
        vespo_k_pos=draw(st.sampled_from([2.0, 0.5])),
        vespo_lambda_pos=draw(st.sampled_from([3.0, 1.0])),
        vespo_k_neg=draw(st.sampled_from([3.0, 1.0])),
        vespo_lambda_neg=draw(st.sampled_from([2.0, 0.5])),
    )
    if options["epsilon_high"] == 3.0 and loss_type != "cispo":
        options["epsilon_high"] = 0.28  # an absolute cap is cispo's reading of epsilon_high only
    return logps, advantages, mask, options


def _assert_same_outputs(got, expected, got_grads, expected_grads, names) -> None:
    """Loss, metrics and gradients equal to the float64 reference's, NaN where it is NaN."""
    assert_close(got.loss, expected.loss, rtol=1e-9, atol=1e-11, equal_nan=True, msg="loss")
    for name, value in expected.metrics.items():
        assert_close(got.metrics[name], value, rtol=1e-9, atol=1e-11, equal_nan=True, msg=name)
    for name, grad, want in zip(names, got_grads, expected_grads, strict=True):
        assert_close(grad, want, rtol=1e-8, atol=1e-11, equal_nan=True, msg=f"d loss / d {name}")


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=loss_problems())
def test_random_options_match_reference(problem):
    """Every loss option drawn at once (masks of weights, per-token advantages, ties, clamps, caps, normalizers,
    row weights), float64: grpo_loss equals the reference in its loss, metrics and gradient."""
    logps, advantages, mask, options = problem
    results = []
    for impl in (reference, grpo_ext):
        x = logps.clone().requires_grad_(True)
        out = impl.grpo_loss(x, advantages, mask, **options)
        out.loss.backward()
        results.append((out, x.grad))
    (expected, expected_grad), (got, grad) = results
    _assert_same_outputs(got, expected, (grad,), (expected_grad,), ("logps",))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problem=loss_problems(seq_len_max=5),
    vocab=st.integers(2, 70),
    temperature=st.sampled_from([1.0, 0.7]),
    logit_scale=st.sampled_from([1.0, 0.6]),
    logit_softcap=st.sampled_from([None, 3.0]),
    entropy_coef=st.sampled_from([0.0, 0.1, -0.2]),
    hidden_chunk=st.sampled_from([None, 1, 4]),
)
def test_random_logits_problems_match_reference(problem, vocab, temperature, logit_scale, logit_softcap, entropy_coef,
                                                hidden_chunk):  # fmt: skip
    """The fused losses under every loss option and logit option drawn at once, float64: grpo_loss_from_logits, and
    grpo_loss_from_hidden in chunks, equal the reference (materialized logits) in loss, metrics and gradients."""
    _, advantages, mask, options = problem
    batch, seq_len = mask.shape
    g = torch.Generator().manual_seed(vocab * 131 + seq_len)
    size = 8
    hidden = torch.randn(batch, seq_len, size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, size, generator=g, dtype=torch.float64) / 2
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    logit_options = dict(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
                         entropy_coef=entropy_coef)  # fmt: skip
    results = []
    for impl in (reference, grpo_ext):
        logits = (hidden @ weight.T).requires_grad_(True)
        out = impl.grpo_loss_from_logits(logits, ids, advantages, mask, **options, **logit_options)
        out.loss.backward()
        results.append((out, logits.grad))
    (expected, expected_grad), (got, grad) = results
    _assert_same_outputs(got, expected, (grad,), (expected_grad,), ("logits",))

    results = []
    for impl, chunk in ((reference, None), (grpo_ext, hidden_chunk)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = impl.grpo_loss_from_hidden(h, w, ids, advantages, mask, chunk_size=chunk, **options, **logit_options)
        out.loss.backward()
        results.append((out, (h.grad, w.grad)))
    (expected, expected_grads), (got, grads) = results
    _assert_same_outputs(got, expected, grads, expected_grads, ("hidden", "weight"))


@settings(max_examples=examples(60), deadline=None)
@given(
    num_groups=st.integers(1, 8),
    group_size=st.integers(1, 40),
    k=st.integers(1, 3),
    nan_fraction=st.floats(0.0, 1.0),
    binary=st.booleans(),
    scale=st.sampled_from(["group", "batch", "none"]),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
    aggregation=st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
    seed=st.integers(0, 2**16),
)
def test_random_rewards_match_reference(num_groups, group_size, k, nan_fraction, binary, scale, baseline,
                                        aggregation, seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_groups * group_size, k, generator=g, dtype=torch.float64)
    if binary:
        rewards = (rewards > 0).double()
    rewards[torch.rand(rewards.shape, generator=g) < nan_fraction] = float("nan")
    kwargs = dict(scale_rewards=scale, baseline=baseline, multi_objective_aggregation=aggregation)
    expected = reference.group_advantages(rewards, group_size, **kwargs)
    got = grpo_ext.group_advantages(rewards, group_size, **kwargs)
    assert torch.isfinite(got.advantages).all()
    for name in ("advantages", "group_mean", "group_std"):
        assert_close(getattr(got, name), getattr(expected, name), rtol=1e-9, atol=1e-9, msg=name)
    assert torch.equal(got.zero_std, expected.zero_std)


@settings(max_examples=examples(60), deadline=None)
@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=8),
    k=st.integers(1, 3),
    nan_fraction=st.floats(0.0, 0.6),
    scale=st.sampled_from(["group", "batch", "none"]),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
    aggregation=st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
    singleton_groups=st.sampled_from(["zero", "verl"]),
    std_ddof=st.sampled_from([0, 1]),
    eps=st.sampled_from([1e-4, 1e-8, 0.5]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_grouped_rewards_match_reference(sizes, k, nan_fraction, scale, baseline, aggregation, singleton_groups,
                                                std_ddof, eps, weighted, seed):  # fmt: skip
    """group_ids: groups of any sizes (empty ones and singletons included) in shuffled rows, with every other option
    drawn too: the kernels equal the reference, and no NaN leaves the op."""
    if sum(sizes) == 0:
        sizes = [*sizes[:-1], 1]
    if aggregation == "normalize_then_sum":
        singleton_groups = "zero"  # verl's singletons are sum_then_normalize only (docs/math.md section 1)
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    group_ids = group_ids[torch.randperm(group_ids.numel(), generator=g)]
    rewards = torch.randn(group_ids.numel(), k, generator=g, dtype=torch.float64)
    rewards[torch.rand(rewards.shape, generator=g) < nan_fraction] = float("nan")
    kwargs = dict(group_ids=group_ids, num_groups=len(sizes) + 1, scale_rewards=scale, baseline=baseline,
                  multi_objective_aggregation=aggregation, singleton_groups=singleton_groups, std_ddof=std_ddof,
                  eps=eps, reward_weights=[0.5, 2.0, -1.0][:k] if weighted else None)  # fmt: skip
    expected = reference.group_advantages(rewards, **kwargs)
    got = grpo_ext.group_advantages(rewards, **kwargs)
    for name in ("advantages", "group_mean", "group_std"):
        assert torch.isfinite(getattr(got, name)).all(), name
        assert_close(getattr(got, name), getattr(expected, name), rtol=1e-9, atol=1e-9, msg=name)
    assert torch.equal(got.zero_std, expected.zero_std)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 9),
    vocab=st.integers(1, 300),
    offset=st.floats(-1e4, 1e4),
    spread=st.floats(0.0, 30.0),
    temperature=st.sampled_from([1.0, 0.3, 2.5]),
    logit_scale=st.sampled_from([1.0, 0.5]),
    logit_softcap=st.sampled_from([None, 2.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_random_selective_log_softmax_matches_reference(rows, vocab, offset, spread, temperature, logit_scale,
                                                        logit_softcap, seed):  # fmt: skip
    """selective_log_softmax on rows of any length, far from 0 or near it, flat or peaked, under every logit
    option, float64: log-probs, entropy and the gradient of a weighted sum of both equal the reference."""
    g = torch.Generator().manual_seed(seed)
    logits = offset + spread * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    upstream = torch.randn(2, rows, generator=g, dtype=torch.float64)
    options = dict(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap, return_entropy=True)
    results = []
    for impl in (reference, grpo_ext):
        x = logits.clone().requires_grad_(True)
        out = impl.selective_log_softmax(x, ids, **options)
        ((upstream[0] * out.logps).sum() + (upstream[1] * out.entropy).sum()).backward()
        results.append((out.logps, out.entropy, x.grad))
    for name, got, want in zip(("logps", "entropy", "grad"), results[1], results[0], strict=True):
        assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


def _float32_limit_agrees(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, name: str) -> None:
    """A float32 kernel value against the float64 reference's on the same inputs at a float32-overflowed ratio: no
    NaN where the reference has none; +-inf (the limit of a large finite rho, docs/math.md section 8) only with the
    reference's sign; a finite value within float32's rounding of the reference's, relative to `terms`, the size of
    the parts summed into it (the policy's and the KL's: where they nearly cancel, as sapo's saturated -4 beside a
    k3 of 4.0067 does, float32 keeps only the bits of the larger ones)."""
    for g, w, t in zip(got.double().flatten().tolist(), want.flatten().tolist(), terms.flatten().tolist(), strict=True):
        if w != w:  # the reference's own indeterminate form
            continue
        assert g == g, (name, g, w)
        if abs(g) == float("inf"):
            assert w != 0 and (g > 0) == (w > 0), (name, g, w)
        else:
            assert abs(g - float(torch.tensor(w).float())) <= 1e-5 * max(abs(w), t) + 1e-30, (name, g, w, t)


@settings(max_examples=examples(500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    log_ratio=st.sampled_from([89.0, 100.0, 300.0, -100.0]),
    kl_gap=st.sampled_from([0.0, 0.5, -0.5, 5.0, -5.0, 30.0]),
    advantage=st.sampled_from([1.0, -1.0, 0.0, 0.5]),
    weight=st.sampled_from([None, 0.0, 0.5]),
    loss_type=st.sampled_from(LOSS_TYPES),
    level=st.sampled_from(["token", "sequence"]),
    beta=st.sampled_from([0.0, 0.04, 1.0]),
    estimator=st.sampled_from(["k1", "k2", "k3", "abs", "k1+", "k3+", "low_var_kl"]),
    bias=st.booleans(),
    kl_clamp=st.sampled_from([None, 2.0]),
    delta=st.sampled_from([None, 3.0]),
)
def test_one_token_at_an_overflowed_ratio_gives_the_reference_limit(
    log_ratio, kl_gap, advantage, weight, loss_type, level, beta, estimator, bias, kl_clamp, delta
):
    """One token (no sum of two tokens' infinities, no global factor but 1) whose ratio overflows float32: the
    float32 kernel's loss and gradient are the float64 reference's on the same inputs (e^300 is finite there) or, where
    float32 cannot hold them, their signed limit; never NaN (docs/math.md section 8). A fuzz of these options found
    the loss's inf - inf (k1's KL < 0 beside A < 0) and inf * 0 (a zero weight), 2026-11-29."""
    logps = torch.full((1, 1), -1.0, dtype=torch.float64)
    options = dict(old_logps=logps - log_ratio, ref_logps=logps + kl_gap, beta=beta, kl_estimator=estimator,
                   use_bias_correction_kl=bias, kl_clamp=kl_clamp, delta=delta, loss_type=loss_type,
                   importance_sampling_level=level,
                   is_weights=None if weight is None else torch.full((1, 1), weight, dtype=torch.float64))  # fmt: skip
    adv, mask = torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1)

    def loss_and_grad(impl, dtype, **changed):
        cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in {**options, **changed}.items()}
        x = logps.to(dtype, copy=True).requires_grad_(True)  # a leaf of its own: no gradient accumulates across calls
        out = impl.grpo_loss(x, adv.to(dtype), mask.to(dtype), **cast)
        out.loss.backward()
        return out.loss.detach().double(), x.grad.double()

    loss, grad = loss_and_grad(grpo_ext, torch.float32)
    want_loss, want_grad = loss_and_grad(reference, torch.float64)
    policy_loss, policy_grad = loss_and_grad(reference, torch.float64, beta=0.0)  # the parts: policy, then KL
    _float32_limit_agrees(loss, want_loss, policy_loss.abs() + (want_loss - policy_loss).abs(), "loss")
    _float32_limit_agrees(grad, want_grad, policy_grad.abs() + (want_grad - policy_grad).abs(), "grad")
