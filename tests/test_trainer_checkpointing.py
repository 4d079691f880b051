"""GRPOConfig.gradient_checkpointing (TRL's option, on by default): the decoder layers recompute in the backward, and
the step is the one without it, on the fused and the plain log-prob paths (float64, so that any other result would
show); generation keeps its KV cache and the no-grad passes are not checkpointed; a resume may switch it; the run
file's key. LoRA: tests/test_trainer_peft.py; DDP and FSDP2: tests/test_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer import trainer as trainer_module
from grpo_ext.trainer.cli import main as cli_main
from grpo_ext.trainer.config import RESUMABLE_FIELDS
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import AttentionCalls, small_config, write_cli_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def float64_trainer(tmp_path, **overrides) -> GRPOTrainer:
    """The demo's tiny LLaMA (2 layers) in float64, beta > 0 and num_iterations=2 (reference and old log-probs)."""
    options = dict(max_steps=2, beta=0.04, num_iterations=2, loss_type="dapo", warmup_steps=0, adam_epsilon=1e-3)
    options.update(overrides)
    tokenizer = build_tokenizer()
    rows, _ = reversal_dataset(seed=0)
    model = build_model(tokenizer, seed=0).double()
    return GRPOTrainer(model, [reversal_reward], rows, small_config(tmp_path, **options), tokenizer=tokenizer)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def one_step(trainer: GRPOTrainer) -> tuple[dict[str, float], list[int]]:
    """One optimizer step on a generated batch: its metrics, and each layer's attention calls in the step alone."""
    trainer._generate_and_score()  # rollouts, old and reference log-probs (no grad)
    calls = AttentionCalls(trainer.model)
    metrics = trainer._training_step()
    calls.remove()
    return metrics, calls.counts


@pytest.mark.parametrize(
    ("backend", "kwargs"),
    [("fused", None), ("plain", None), ("fused", {"use_reentrant": True})],
    ids=["fused", "plain", "fused_reentrant"],
)
def test_checkpointing_recomputes_the_layers_and_gives_the_same_step(tmp_path, backend, kwargs):
    """One optimizer step (float64) with gradient checkpointing equals the step without it: the same gradient norm
    and parameter update to 1e-12; each layer's attention runs twice in the step (forward, then the recompute in the
    backward) instead of once, so an ignored option fails."""
    runs = {}
    for on in (False, True):
        trainer = float64_trainer(tmp_path / str(on), logps_backend=backend, gradient_checkpointing=on,
                                  gradient_checkpointing_kwargs=kwargs)  # fmt: skip
        assert trainer.policy_fused == (backend == "fused")
        before = parameters(trainer.model)
        metrics, calls = one_step(trainer)
        assert calls == ([2, 2] if on else [1, 1])
        after = parameters(trainer.model)
        runs[on] = metrics, {name: after[name] - before[name] for name in after}
    assert runs[True][0]["grad_norm"] == pytest.approx(runs[False][0]["grad_norm"], rel=1e-12)
    assert runs[True][0]["loss"] == pytest.approx(runs[False][0]["loss"], rel=1e-12, abs=1e-15)
    assert max(update.abs().max().item() for update in runs[False][1].values()) > 1e-4  # the step moved the weights
    for name, update in runs[True][1].items():
        torch.testing.assert_close(update, runs[False][1][name], rtol=0, atol=1e-12, msg=name)


def counted(function, calls: list[int]):
    """``function``, appending to ``calls`` at each call."""

    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper


def test_generation_keeps_its_cache_and_no_grad_passes_are_not_checkpointed(tmp_path):
    """Under checkpointing (a model left in training mode), generate still decodes one position per new token from
    its KV cache, the rollouts equal those without checkpointing, the reference model is not checkpointed, and no
    checkpoint runs in the generation and the no-grad old-policy and reference passes."""
    rollouts = {}
    for on in (False, True):
        trainer = float64_trainer(tmp_path / str(on), gradient_checkpointing=on)
        layers = trainer.model.model.layers
        assert all(layer.gradient_checkpointing == on for layer in layers)
        assert not any(layer.gradient_checkpointing for layer in trainer.ref_model.model.layers)
        checkpoint_calls: list[int] = []
        for layer in layers if on else []:
            layer._gradient_checkpointing_func = counted(layer._gradient_checkpointing_func, checkpoint_calls)
        trainer.model.train()
        calls = AttentionCalls(trainer.model)
        _, prompt_mask, _, completion_mask, _ = trainer.generate(["123>", "45>"], 1, greedy=True)
        new_tokens = completion_mask.shape[1]
        # the prompt once, then one position per new token (the last token needs no forward)
        assert calls.positions == [prompt_mask.shape[1]] + [1] * (new_tokens - 1)
        calls.remove()
        trainer._generate_and_score()
        assert checkpoint_calls == []
        rollouts[on] = trainer._micro_batches[0]
        trainer._training_step()
        assert len(checkpoint_calls) == (len(layers) if on else 0)
    for key in ("completion_ids", "completion_mask", "old_logps", "ref_logps"):
        assert torch.equal(rollouts[True][key], rollouts[False][key]), key


def test_a_resume_may_switch_checkpointing(tmp_path):
    """gradient_checkpointing and its kwargs change no result: a run saved with it on resumes with it off (and the
    other way) and ends where the uninterrupted run does; both fields are resume-changeable."""
    assert {"gradient_checkpointing", "gradient_checkpointing_kwargs"} <= RESUMABLE_FIELDS
    uninterrupted = float64_trainer(tmp_path / "whole", max_steps=3)
    uninterrupted.train()
    expected = parameters(uninterrupted.model)
    for first, second in ((True, False), (False, True)):
        run = tmp_path / f"from_{first}"
        float64_trainer(run, max_steps=1, save_steps=1, gradient_checkpointing=first).train()
        resumed = float64_trainer(run, max_steps=3, gradient_checkpointing=second,
                                  gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
        resumed.train(resume_from_checkpoint=True)
        assert resumed.global_step == 3
        for name, value in parameters(resumed.model).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


def test_config_default_and_checkpointing_kwargs():
    assert GRPOConfig().gradient_checkpointing is True  # TRL's default
    assert GRPOConfig().gradient_checkpointing_kwargs is None  # use_reentrant=False when enabled
    given = {"use_reentrant": True}
    config = GRPOConfig(gradient_checkpointing_kwargs=given)
    given["use_reentrant"] = False
    assert config.gradient_checkpointing_kwargs == {"use_reentrant": True}  # a copy: the caller's dict stays theirs
    assert GRPOConfig.from_dict(config.to_dict()) == config  # the checkpoint's config.grpo.json round trip


def test_a_model_without_checkpointing_support_is_refused_naming_the_option(tmp_path):
    tokenizer = build_tokenizer()
    rows, _ = reversal_dataset(seed=0)
    model = build_model(tokenizer)
    model.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match=r"GRPOConfig\.gradient_checkpointing=True needs a model that supports it.*"
                                         r"LlamaForCausalLM does not: set gradient_checkpointing=False"):  # fmt: skip
        GRPOTrainer(model, [reversal_reward], rows, small_config(tmp_path), tokenizer=tokenizer)
    trainer = GRPOTrainer(model, [reversal_reward], rows, small_config(tmp_path, gradient_checkpointing=False),
                          tokenizer=tokenizer)  # fmt: skip
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())


def test_the_run_file_key_and_its_override(tmp_path, monkeypatch):
    """``gradient_checkpointing: false`` in a run file trains without it; ``--gradient_checkpointing true`` with the
    run file's ``gradient_checkpointing_kwargs`` enables it with them; the run's config records the setting."""
    enabled = []
    original = trainer_module.enable_gradient_checkpointing
    monkeypatch.setattr(trainer_module, "enable_gradient_checkpointing",
                        lambda model, kwargs: enabled.append(kwargs) or original(model, kwargs))  # fmt: skip
    run_file = write_cli_inputs(tmp_path, gradient_checkpointing=False,
                                gradient_checkpointing_kwargs={"use_reentrant": True}, max_steps=1,
                                save_steps=1)  # fmt: skip
    argv = ["train", "--config", str(run_file)]
    assert cli_main([*argv, "--output_dir", str(tmp_path / "off")]) == 0
    assert enabled == []
    saved = json.loads((tmp_path / "off" / "checkpoint-1" / "config.grpo.json").read_text())
    assert saved["gradient_checkpointing"] is False
    assert cli_main([*argv, "--output_dir", str(tmp_path / "on"), "--gradient_checkpointing", "true"]) == 0
    assert enabled == [{"use_reentrant": True}]


def test_the_readme_lists_the_fields_a_resume_may_change():
    """README's "Changing the config on --resume" names exactly RESUMABLE_FIELDS (an outside audit, 2026-11-29: two
    were missing)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    paragraph = readme.split("**Changing the config on `--resume`.**", 1)[1].split("`RESUMABLE_FIELDS`", 1)[0]
    listed = set(re.findall(r"`([a-z_0-9]+)`", paragraph)) - {"GRPOConfig"}
    assert listed == RESUMABLE_FIELDS
