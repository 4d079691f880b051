"""grpo_ext.nn.FusedLinearGRPOLoss (Liger's LigerFusedLinearGRPOLoss interface) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, assert_close
from grpo_ext import reference
from grpo_ext.nn import FusedLinearGRPOLoss

LIGER_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


def make_problem(batch: int = 4, length: int = 5, size: int = 16, ref_size: int = 12, vocab: int = 37, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, size, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(vocab, size, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(vocab, generator=g, dtype=torch.float64)
    ref_hidden = torch.randn(batch, length, ref_size, generator=g, dtype=torch.float64)
    ref_weight = 0.5 * torch.randn(vocab, ref_size, generator=g, dtype=torch.float64)
    ref_bias = 0.3 * torch.randn(vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) < 0.75
    mask[0] = False
    mask[1] = True
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    old = 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64) - 3.0
    return hidden, weight, bias, ids, mask, adv, old, (ref_hidden, ref_weight, ref_bias)


def expected_loss(hidden, weight, bias, ids, mask, adv, old, ref_head, *, beta, loss_type, level, temperature):
    """The float64 reference: reference log-probs from the materialized reference logits, then the loss."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref_hidden, ref_weight, ref_bias = ref_head
    ref_logps = reference.selective_log_softmax(ref_hidden @ ref_weight.t() + ref_bias, ids,
                                                temperature=temperature).logps  # fmt: skip
    out = reference.grpo_loss_from_hidden(
        leaves[0], leaves[1], ids, adv, mask, lm_head_bias=leaves[2], temperature=temperature, old_logps=old,
        ref_logps=ref_logps, beta=beta, epsilon=0.2, epsilon_high=0.28 if loss_type != "cispo" else 4.0,
        loss_type=loss_type, importance_sampling_level=level,
    )  # fmt: skip
    out.loss.backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LIGER_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_matches_reference_with_ref_head(device, loss_type, level, chunk_size):
    problem = make_problem(seed=LIGER_LOSS_TYPES.index(loss_type))
    hidden, weight, bias, ids, mask, adv, old, ref_head = problem
    expected, expected_grads = expected_loss(*problem, beta=0.05, loss_type=loss_type, level=level, temperature=0.8)
    module = FusedLinearGRPOLoss(beta=0.05, chunk_size=chunk_size, epsilon_low=0.2,
                                 epsilon_high=0.28 if loss_type != "cispo" else 4.0, loss_type=loss_type,
                                 importance_sampling_level=level, temperature=0.8)  # fmt: skip
    f32 = [t.to(device, torch.float32).requires_grad_(True) for t in (hidden, weight, bias)]
    ref32 = [t.to(device, torch.float32).requires_grad_(True) for t in ref_head]
    loss, (kl, clip) = module(f32[0], f32[1], ids.to(device), mask.to(device), adv.to(device, torch.float32),
                              f32[2], None, old.to(device, torch.float32), *ref32)  # fmt: skip
    loss.backward()
    assert_close(loss, expected.loss, rtol=3e-5, atol=3e-5, msg="loss")
    for name, got, want in zip(("input", "weight", "bias"), (t.grad for t in f32), expected_grads, strict=True):
        assert_close(got, want, rtol=3e-4, atol=3e-5, msg=f"grad {name}")
    assert all(t.grad is None for t in ref32), "no gradient may reach the reference head"
    assert_close(kl, expected.metrics["kl"], rtol=3e-5, atol=3e-5, msg="kl")
    clip_name = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"
    assert_close(clip, expected.metrics[clip_name], rtol=3e-5, atol=3e-5, msg=clip_name)


def test_ref_head_equals_given_ref_logps_and_no_reference_means_no_kl():
    hidden, weight, bias, ids, mask, adv, old, (ref_hidden, ref_weight, ref_bias) = make_problem(seed=7)
    ref_logps = reference.selective_log_softmax(ref_hidden @ ref_weight.t() + ref_bias, ids).logps
    module = FusedLinearGRPOLoss(beta=0.1, loss_type="grpo")
    from_head, metrics_head = module(hidden, weight, ids, mask, adv, bias, None, old, ref_hidden, ref_weight, ref_bias)
    from_logps, metrics_logps = module(hidden, weight, ids, mask, adv, bias, ref_logps, old)
    assert_close(from_head, from_logps, rtol=1e-12, atol=1e-12)
    assert_close(metrics_head[0], metrics_logps[0], rtol=1e-12, atol=1e-12)
    assert metrics_head[0] > 0
    # Liger: without a reference (or with use_ref_model=False) the KL is KL[pi || sg(pi)] = 0, value and gradient
    without, (kl, _) = module(hidden, weight, ids, mask, adv, bias, None, old)
    no_ref_model = FusedLinearGRPOLoss(beta=0.1, loss_type="grpo", use_ref_model=False)
    ignored, _ = no_ref_model(hidden, weight, ids, mask, adv, bias, ref_logps, old)
    no_kl = FusedLinearGRPOLoss(beta=0.0, loss_type="grpo")
    beta_zero, metrics = no_kl(hidden, weight, ids, mask, adv, bias, None, old)
    assert kl == 0 and len(metrics) == 1
    assert_close(without, beta_zero, rtol=1e-12, atol=1e-12)
    assert_close(ignored, beta_zero, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(from_head, beta_zero)


def test_bad_arguments_are_named():
    hidden, weight, bias, ids, mask, adv, old, (ref_hidden, ref_weight, _) = make_problem(seed=3)
    module = FusedLinearGRPOLoss()
    with pytest.raises(ValueError, match="ref_input and ref_weight"):
        module(hidden, weight, ids, mask, adv, bias, None, old, ref_hidden)
    with pytest.raises(ValueError, match="ref_weight must have shape"):
        module(hidden, weight, ids, mask, adv, bias, None, old, ref_hidden, ref_weight[:5])
    with pytest.raises(ValueError, match=r"ref_input must have shape \[B, T, H\] with \[B, T\]=\(4, 5\)"):
        module(hidden, weight, ids, mask, adv, bias, None, old, ref_hidden[:2], ref_weight)
    with pytest.raises(ValueError, match="ref_input must hold"):  # [N, H'] rows: only their number is checked
        module(hidden, weight, ids, mask, adv, bias, None, old, ref_hidden.flatten(0, 1)[:-1], ref_weight)
    with pytest.raises(ValueError, match="_input must be"):
        module(hidden.flatten(0, 1), weight, ids, mask, adv, bias)
    with pytest.raises(TypeError, match="unexpected keyword"):
        FusedLinearGRPOLoss(epsilon=0.3)
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLinearGRPOLoss(chunk_size=0)


@pytest.mark.parametrize("chunk_size", [1, None])
def test_masked_rows_get_zero_input_grad_with_a_non_finite_weight(chunk_size):
    """The module goes through grpo_loss_from_hidden's chunked path: a NaN LM-head weight makes the loss NaN, yet
    the masked positions' ``_input`` gradient is exactly 0, as the reference's."""
    hidden, weight, bias, ids, mask, adv, old, ref_head = make_problem(seed=11)
    weight = weight.clone()
    weight[2, 7] = float("nan")
    _, expected_grads = expected_loss(hidden, weight, bias, ids, mask, adv, old, ref_head, beta=0.0,
                                      loss_type="dapo", level="token", temperature=1.0)  # fmt: skip
    assert (expected_grads[0][~mask] == 0).all() and expected_grads[0][mask].isnan().all()
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    module = FusedLinearGRPOLoss(beta=0.0, chunk_size=chunk_size, epsilon_low=0.2, epsilon_high=0.28)
    loss, _ = module(leaves[0], leaves[1], ids, mask, adv, leaves[2], None, old)
    loss.backward()
    assert loss.isnan()
    for name, got, want in zip(("input", "weight", "bias"), (t.grad for t in leaves), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, equal_nan=True, msg=f"grad {name}")


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_vespo_returns_its_phi_mean_in_the_clip_ratio_place(beta):
    """loss_type="vespo" (no clip ratio of its own) runs, matches the float64 reference, and returns vespo's
    ``vespo/phi_seq_mean`` where the other loss types return their clip ratio."""
    hidden, weight, bias, ids, mask, adv, old, ref_head = make_problem(seed=5)
    expected, expected_grads = expected_loss(hidden, weight, bias, ids, mask, adv, old, ref_head, beta=beta,
                                             loss_type="vespo", level="token", temperature=0.9)  # fmt: skip
    module = FusedLinearGRPOLoss(beta=beta, chunk_size=1, epsilon_low=0.2, epsilon_high=0.28, loss_type="vespo",
                                 temperature=0.9)  # fmt: skip
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, metrics = module(leaves[0], leaves[1], ids, mask, adv, leaves[2], None, old, *ref_head)
    loss.backward()
    assert_close(loss, expected.loss, rtol=1e-10, atol=1e-12, msg="loss")
    for name, got, want in zip(("input", "weight", "bias"), (t.grad for t in leaves), expected_grads, strict=True):
        assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"grad {name}")
    assert len(metrics) == (2 if beta else 1)
    if beta:
        assert_close(metrics[0], expected.metrics["kl"], rtol=1e-10, atol=1e-12, msg="kl")
    phi = expected.metrics["vespo/phi_seq_mean"]
    assert phi > 0 and not torch.isclose(phi, torch.ones_like(phi))  # a real weight, not a constant stand-in
    assert_close(metrics[-1], phi, rtol=1e-10, atol=1e-12, msg="vespo/phi_seq_mean")
