"""grpo_ext.integrations.trl's patching itself: patch() and unpatch() on a real ``trl.GRPOTrainer``, what a subclass
keeps, the settings and values refused (named before any model loads where possible), the TRL releases accepted and
the internals each one needs, and what ``import grpo_ext`` leaves alone. The parity of the patched loss with TRL's:
tests/test_trl_integration.py; the helpers and fixtures: tests/trl_utils.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

# importing trl_utils skips this module when trl is missing or unsupported (fails with GRPO_EXT_REQUIRE_TRL=1)
from trl_utils import (
    TRL_RELEASE,
    Float64Head,
    compare,
    digit_reward,
    grpo_ext_calls_fixture,  # noqa: F401  (the fixtures)
    grpo_trl,
    llama_dir_fixture,  # noqa: F401
    make_inputs,
    make_trainer,
    tokenizer_fixture,  # noqa: F401
    trl,
)

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_patch_is_idempotent_and_unpatch_restores_trl(llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    trainer = make_trainer(llama_dir, tokenizer, tmp_path, loss_type="grpo")
    inputs = make_inputs(trainer)
    assert grpo_trl.patch(grpo_trl.patch(trainer)) is trainer and grpo_trl.is_patched(trainer)
    assert trainer.logps_backend == "fused"
    fused_loss = trainer.compute_loss(trainer.model, inputs)
    assert grpo_ext_calls.grpo_loss_from_hidden == 1 and grpo_ext_calls.grpo_loss == 0
    grpo_trl.patch(trainer, logps_backend="plain")  # patching again switches the backend
    plain_loss = trainer.compute_loss(trainer.model, inputs)
    assert grpo_ext_calls.grpo_loss_from_hidden == 1 and grpo_ext_calls.grpo_loss == 1
    grpo_trl.unpatch(trainer)
    assert not grpo_trl.is_patched(trainer) and not hasattr(trainer, "logps_backend")
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    assert grpo_ext_calls.grpo_loss_from_hidden == 1 and grpo_ext_calls.grpo_loss == 1  # TRL's own code again
    torch.testing.assert_close(fused_loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain_loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)


def test_unsupported_settings_raise_naming_them(llama_dir, tokenizer, tmp_path):
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    config.loss_type = "ppo_made_up"  # a later TRL's loss type, say
    with pytest.raises(ValueError, match=r"GRPOConfig\.loss_type='ppo_made_up' is not supported"):
        # raised before TRL loads anything: the model path does not even exist
        grpo_trl.GRPOExtTrainer(model=str(tmp_path / "missing"), reward_funcs=digit_reward, args=config)
    with pytest.raises(ValueError, match=r"logps_backend must be one of \('fused', 'plain'\), got 'fast'"):
        grpo_trl.patch(make_trainer(llama_dir, tokenizer, tmp_path), logps_backend="fast")
    with pytest.raises(ValueError, match=r"logps_backend must be one of \('fused', 'plain'\), got 'logits'"):
        grpo_trl.GRPOExtTrainer(
            model=str(tmp_path / "missing"), reward_funcs=digit_reward, logps_backend="logits",
            args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"trainer must be a trl\.GRPOTrainer, got object"):
        grpo_trl.patch(object())
    # values TRL takes and grpo_ext's losses refuse: named when the trainer is built, not after the first generation
    for field, value, message in (("delta", 0.9, "delta must exceed 1"), ("beta", -0.01, "beta must be >= 0"),
                                  ("epsilon_high", -0.05, "epsilon_high must be >= 0")):  # fmt: skip
        config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="dapo")
        setattr(config, field, value)
        with pytest.raises(ValueError, match=rf"GRPOConfig\.{message}.*unpatched trl\.GRPOTrainer"):
            grpo_trl.GRPOExtTrainer(model=str(tmp_path / "missing"), reward_funcs=digit_reward, args=config)
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"outputs=.*'is_top1'"):
        grpo_trl._GrpoExtLogProbs.apply(hidden, weight, None, torch.zeros(3, dtype=torch.long), 1.0, 8, None, 1.0,
                                        ("log_probs", "is_top1"))  # fmt: skip


class OwnLossTrainer(trl.GRPOTrainer):
    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs) + 100.0


class OwnGammaWeightsTrainer(trl.GRPOTrainer):
    @staticmethod
    def get_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, **kwargs):
        return torch.full_like(advantages if advantages.dim() == 2 else advantages.unsqueeze(1), 0.5)


def test_patch_keeps_a_subclass_loss_and_refuses_an_uncallable_hook(llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    """An outside audit (2026-11-29): patch() replaced a subclass's own _compute_loss and ignored an overridden
    get_gamma_weights, both silently."""
    reference = make_trainer(llama_dir, tokenizer, tmp_path, cls=OwnLossTrainer, loss_type="grpo")
    inputs = make_inputs(reference)
    want = reference.compute_loss(reference.model, inputs).detach()
    with pytest.warns(UserWarning, match=r"OwnLossTrainer\._compute_loss is kept"):
        grpo_trl.patch(reference)
    got = reference.compute_loss(reference.model, inputs).detach()
    assert got.item() > 90  # the subclass's +100 is still there
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grpo_ext_calls.selective_log_softmax >= 1 and grpo_ext_calls.grpo_loss_from_hidden == 0
    vespo = make_trainer(llama_dir, tokenizer, tmp_path, cls=OwnGammaWeightsTrainer, loss_type="vespo")
    with pytest.raises(ValueError, match="OwnGammaWeightsTrainer overrides get_gamma_weights"):
        grpo_trl.patch(vespo)
    hook = {"get_gamma_weights": OwnGammaWeightsTrainer.get_gamma_weights}
    ours = type("OwnGammaWeightsExtTrainer", (grpo_trl.GRPOExtTrainer,), hook)
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="vespo")
    with pytest.raises(ValueError, match="OwnGammaWeightsExtTrainer overrides get_gamma_weights"):
        ours(model=str(tmp_path / "missing"), reward_funcs=digit_reward, args=config)  # before the model loads
    grpo_trl.patch(make_trainer(llama_dir, tokenizer, tmp_path, cls=OwnGammaWeightsTrainer, loss_type="grpo"))


@pytest.mark.parametrize("version", ["1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0", "1.16.5"])
def test_check_trl_version_accepts_1_14_to_1_16(version):
    grpo_trl.check_trl_version(version)


@pytest.mark.parametrize("version", ["1.13.2", "1.17.0", "2.0.0", "0.29.0", "unknown"])
def test_check_trl_version_refuses_other_releases_naming_the_range(version):
    with pytest.raises(RuntimeError, match=rf"supports trl 1\.14\.x to 1\.16\.x .* found trl {version}: "
                                           r"pip install 'trl>=1\.14\.0,<1\.17'"):  # fmt: skip
        grpo_trl.check_trl_version(version)


def test_missing_internal_is_named(monkeypatch, llama_dir, tokenizer, tmp_path):
    """Each TRL name the integration hooks in this release, taken away, is named by the error (before any patch)."""
    internals = grpo_trl.compat.required_internals()
    names = {internal.path for internal in internals}
    # the slot the log-probs go through: 1.15/1.16's fused head, 1.14's chunked path
    assert ("trl.trainer.utils.add_fused_lm_head" in names) == (TRL_RELEASE != (1, 14))
    assert ("trl.trainer.grpo_trainer._ChunkedLogProbFunction" in names) == (TRL_RELEASE == (1, 14))
    grpo_trl.check_trl_version()
    trainer = make_trainer(llama_dir, tokenizer, tmp_path)
    for internal in internals:
        with monkeypatch.context() as patched:
            patched.delattr(internal.resolve_owner(), internal.name)
            message = f"trl {re.escape(trl.__version__)} has no {re.escape(internal.path)}, which grpo_ext"
            with pytest.raises(RuntimeError, match=message):
                grpo_trl.check_trl_version()
            with pytest.raises(RuntimeError, match=message):
                grpo_trl.patch(trainer)
        assert not grpo_trl.is_patched(trainer)
    grpo_trl.check_trl_version()  # every name back


def test_default_config_takes_this_releases_path(llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    """TRL's default config (``use_liger_kernel=False``): 1.15/1.16 score through the fused head, so the loss is
    fused; 1.14 scores from full logits, so the loss takes the log-prob path (its log-probs from grpo_ext's
    ``selective_log_softmax`` on TRL's logits), with a warning naming the setting. Both give TRL's numbers."""
    trainer = make_trainer(llama_dir, tokenizer, tmp_path, chunked=False, loss_type="dapo", beta=0.04)
    fallback = "use_liger_kernel=True" if TRL_RELEASE == (1, 14) else None
    compare(trainer, make_inputs(trainer, tool_mask=True), grpo_ext_calls, fallback=fallback)


def test_float64_head_matches_trl_head(tokenizer):
    """The stand-in for TRL 1.15's Triton-only head (tests/trl_utils.py) against the chunked head of this TRL."""
    if TRL_RELEASE == (1, 15) and not torch.cuda.is_available():
        pytest.skip("TRL 1.15's chunked head runs on CUDA/XPU only")
    device = "cuda" if TRL_RELEASE == (1, 15) else "cpu"
    module, name = grpo_trl.compat.head_slot()
    head = getattr(module, name)
    assert head is not Float64Head
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (torch.randn(*shape, generator=g, dtype=torch.float64).to(device).float()
                            for shape in ((13, 16), (50, 16), (50,)))  # fmt: skip
    targets = torch.randint(0, 50, (13,), generator=g).to(device)
    w_logps, w_entropy = torch.randn(13, generator=g).to(device), torch.randn(13, generator=g).to(device)
    options = (0.7, 8, 3.0, 0.8)  # temperature, TRL's tile width, soft-cap, logit scale
    results = []
    for fn in (head, Float64Head):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        extra = () if fn is head and TRL_RELEASE == (1, 14) else (("log_probs", "entropy"),)
        logps, entropy, *_ = fn.apply(*leaves, targets, *options, *extra)
        ((logps * w_logps).sum() + (entropy * w_entropy).sum()).backward()
        results.append([logps.detach(), entropy.detach(), *(leaf.grad for leaf in leaves)])
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(expected.abs().max().item(), 1.0))


def test_import_grpo_ext_does_not_import_trl():
    code = "import sys, grpo_ext; assert 'trl' not in sys.modules and 'grpo_ext.integrations' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
