"""loss_type="vespo" against TRL 1.16's own code: ``GRPOTrainer.get_gamma_weights`` and its vespo loss lines.

The kernel and the reference are compared with TRL's numbers (values, gradients and ``vespo/phi_seq_mean``) on the
same inputs, in float64: ragged rows and an empty one, advantages of both signs and zero, per-row and per-token
advantages, log-ratios beyond TRL's +-20 clamp, vLLM importance-sampling ratios with a zero among them, the KL term
with TRL's bias correction, and non-default ``vespo_k_*``/``vespo_lambda_*``. The whole TRL trainer is compared in
tests/test_trl_integration.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference

if os.environ.get("GRPO_EXT_REQUIRE_TRL") == "1":  # `make test`: a missing trl fails instead of skipping
    import trl
else:
    trl = pytest.importorskip("trl")

B, T = 6, 7
LENGTHS = (7, 3, 0, 5, 1, 6)
PARAMS = {
    "trl_defaults": dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
    "custom": dict(vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=0.0),  # lambda -> 1e-4
}


def make_inputs(seed: int, token_advantages: bool, is_ratio: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T) < torch.tensor(LENGTHS)[:, None]
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    drift = 0.4 * torch.randn(B, 1, generator=g, dtype=torch.float64) + 0.3 * torch.randn(B, T, generator=g,
                                                                                          dtype=torch.float64)
    drift[5, 2] = 25.0  # beyond TRL's +-20 clamp of a token's log-ratio
    advantages = torch.tensor([1.2, -0.8, 0.5, 0.0, -1.5, 0.9], dtype=torch.float64)
    if token_advantages:
        advantages = advantages[:, None] * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.3)
    inputs = dict(logps=logps, old_logps=logps - drift, ref_logps=logps + 0.2 * torch.randn(B, T, generator=g,
                  dtype=torch.float64), advantages=advantages, mask=mask)  # fmt: skip
    if is_ratio:  # TRL's vLLM ratio: 1 on padding (its log-ratio there is masked to 0), a zero (token_mask) on row 0
        ratio = (0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)).masked_fill(~mask, 1.0)
        ratio[0, 3] = 0.0
        inputs["is_weights"] = ratio
    return inputs


def trl_vespo(inputs: dict, params: dict, beta: float, num_items: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """TRL 1.16's vespo loss (GRPOTrainer._compute_loss with importance_sampling_level="token", bias-corrected KL):
    the loss, d loss / d logps and its ``vespo/phi_seq_mean``."""
    logps = inputs["logps"].clone().requires_grad_(True)
    mask = inputs["mask"].to(torch.float64)
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - inputs["old_logps"]
    phi_seq = trl.GRPOTrainer.get_gamma_weights(
        advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
        importance_sampling_ratio=inputs.get("is_weights"), **{name[len("vespo_"):]: v for name, v in params.items()},
    )  # fmt: skip
    per_token_loss = -phi_seq * advantages * logps
    if beta != 0.0:
        ref = inputs["ref_logps"]
        per_token_kl = (torch.exp(ref - logps) - (ref - logps) - 1) * torch.exp(log_ratio)
        per_token_loss = per_token_loss + beta * per_token_kl
    loss = (per_token_loss * mask).sum() / num_items
    loss.backward()
    if phi_seq.shape[1] == 1:
        phi_mean = phi_seq.sum() / B
    else:
        phi_mean = (phi_seq * mask).sum() / mask.sum().clamp(min=1.0)
    return loss.detach(), logps.grad, float(phi_mean)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("token_advantages", [False, True], ids=["row_adv", "token_adv"])
@pytest.mark.parametrize("is_ratio", [False, True], ids=["no_is", "vllm_is"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_vespo_reproduces_trl(device, params, token_advantages, is_ratio, beta):
    inputs = make_inputs(seed=len(params) + 2 * token_advantages + is_ratio, token_advantages=token_advantages,
                         is_ratio=is_ratio)  # fmt: skip
    num_items = 13.0
    want_loss, want_grad, want_phi = trl_vespo(inputs, PARAMS[params], beta, num_items)
    kwargs = dict(loss_type="vespo", old_logps=inputs["old_logps"], is_weights=inputs.get("is_weights"), beta=beta,
                  ref_logps=inputs["ref_logps"] if beta else None, use_bias_correction_kl=True,
                  num_items_in_batch=num_items, **PARAMS[params])  # fmt: skip
    for impl, dev in ((reference, "cpu"), (grpo_ext, device)):
        logps = inputs["logps"].to(dev).clone().requires_grad_(True)
        moved = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = impl.grpo_loss(logps, inputs["advantages"].to(dev), inputs["mask"].to(dev), **moved)
        out.loss.backward()
        name = impl.__name__
        assert_close(out.loss.cpu(), want_loss, rtol=1e-10, atol=1e-12, msg=f"{name} loss")
        assert_close(logps.grad.cpu(), want_grad, rtol=1e-10, atol=1e-12, msg=f"{name} grad")
        assert out.metrics["vespo/phi_seq_mean"].item() == pytest.approx(want_phi, rel=1e-10, abs=1e-12), name
        assert not any(key.startswith("clip_ratio") for key in out.metrics)  # TRL logs no clip share for vespo
    assert want_grad.abs().max() > 0 and want_phi != pytest.approx(1.0)  # the weights differ from 1: not vacuous


@pytest.mark.parametrize("device", DEVICES)
def test_vespo_phi_overflow_is_zero_as_in_trl(device):
    """A phi beyond float32's range is 0 in float32 (TRL's nan_to_num(posinf=0)), kernel and reference alike."""
    logps = torch.full((1, 4), -1.0)
    old = logps + 4.6  # log w = -18.4: phi = exp(lambda + k * log w - lambda * w) overflows for k = -6
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for impl, dev in ((reference, "cpu"), (grpo_ext, device)):
        leaf = logps.to(dev).clone().requires_grad_(True)
        out = impl.grpo_loss(leaf, adv.to(dev), mask.to(dev), old_logps=old.to(dev), loss_type="vespo",
                             vespo_k_pos=-6.0)  # fmt: skip
        out.loss.backward()
        assert out.loss.item() == 0.0 and (leaf.grad == 0).all(), impl.__name__
        assert out.metrics["vespo/phi_seq_mean"].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["logps", "old_logps", "is_weights"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_vespo_masked_positions_keep_a_zero_gradient_when_a_kept_input_is_not_finite(device, where, value):
    """One non-finite kept input makes the row's phi NaN; the row's masked positions are still inert (docs/math.md:
    their gradient is 0), as in the reference. The CPU token loop once multiplied the NaN phi into them."""
    inputs = make_inputs(seed=3, token_advantages=False, is_ratio=True)
    row = 3  # 5 kept tokens, 2 masked ones
    assert inputs["mask"][row].any() and not inputs["mask"][row].all()
    inputs[where][row, 1] = value
    kwargs = dict(old_logps=inputs["old_logps"], is_weights=inputs["is_weights"], loss_type="vespo")
    ref_logps = inputs["logps"].clone().requires_grad_(True)
    expected = reference.grpo_loss(ref_logps, inputs["advantages"], inputs["mask"], **kwargs)
    expected.loss.backward()
    logps = inputs["logps"].to(device).requires_grad_(True)
    out = grpo_ext.grpo_loss(logps, inputs["advantages"].to(device), inputs["mask"].to(device),
                             **{k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()})  # fmt: skip
    out.loss.backward()
    masked = ~inputs["mask"]
    assert torch.isnan(out.loss) and torch.isnan(expected.loss)
    assert (ref_logps.grad[masked] == 0).all(), "the reference"
    assert (logps.grad.cpu()[masked] == 0).all(), "the kernel"
    assert torch.equal(torch.isnan(logps.grad.cpu()), torch.isnan(ref_logps.grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_vespo_masked_rows_keep_a_zero_gradient_through_logits_and_hidden(device, entry):
    """The same rule through grpo_loss_from_logits and grpo_loss_from_hidden: a +inf kept old log-prob makes the
    loss NaN and leaves the masked rows' gradients (logits, hidden states) zero."""
    inputs = make_inputs(seed=4, token_advantages=False, is_ratio=False)
    inputs["old_logps"][3, 1] = float("inf")
    g = torch.Generator().manual_seed(4)
    vocab, size = 11, 5
    ids = torch.randint(0, vocab, (B, T), generator=g).to(device)
    args = (inputs["advantages"].to(device), inputs["mask"].to(device))
    kwargs = dict(old_logps=inputs["old_logps"].to(device), loss_type="vespo")
    if entry == "logits":
        x = torch.randn(B, T, vocab, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
        out = grpo_ext.grpo_loss_from_logits(x, ids, *args, **kwargs)
    else:
        x = torch.randn(B, T, size, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
        weight = torch.randn(vocab, size, generator=g, dtype=torch.float64).to(device)
        out = grpo_ext.grpo_loss_from_hidden(x, weight, ids, *args, **kwargs)
    out.loss.backward()
    assert torch.isnan(out.loss)
    assert (x.grad.cpu()[~inputs["mask"]] == 0).all()
