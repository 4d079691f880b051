"""GRPOConfig: every field's check names it, the loss options are checked as the loss checks them, defaults,
bounds and the trainer's own checks of its inputs (no training run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grpo_ext
from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer.trainer import GRPOTrainer
from grpo_ext.validation.options import LossOptions
from trainer_utils import make_trainer, small_config

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_generations", 1), ("learning_rate", 0.0), ("learning_rate", float("nan")), ("beta", -0.1),
        ("epsilon", -0.1), ("delta", 1.0), ("top_p", 1.5), ("temperature", -1.0), ("loss_type", "ppo"),
        ("scale_rewards", "rank"), ("importance_sampling_level", "sentence"), ("num_iterations", 0),
        ("max_completion_length", 0), ("gradient_accumulation_steps", 2.5), ("max_steps", 0),
        ("reward_weights", "1,2"), ("reward_weights", [1.0, float("inf")]), ("max_grad_norm", 0.0),
        ("warmup_ratio", 1.0), ("lr_scheduler_type", "cosine_restarts"), ("adam_beta2", 1.0),
        ("kl_target", -1.0), ("kl_target", 0.1), ("logps_backend", "triton"),
        # a string is not a boolean: "false" used to turn bf16 on
        ("bf16", "false"), ("mask_truncated_completions", "false"), ("disable_tqdm", "no"), ("log_completions", 1),
        ("plot", "true"), ("learning_rate", "1e-3"), ("output_dir", 3), ("max_consecutive_nonfinite_steps", 0),
        ("gradient_checkpointing", "false"), ("gradient_checkpointing_kwargs", "use_reentrant=False"),
        # a False preserve_rng_state would recompute dropout with other masks: refused, as are unknown keys
        ("gradient_checkpointing_kwargs", {"preserve_rng_state": False}), ("gradient_checkpointing_kwargs", {"x": 1}),
        ("gradient_checkpointing_kwargs", {"use_reentrant": "no"}),
        ("gradient_checkpointing_kwargs", {"determinism_check": "always"}),
        ("gradient_checkpointing_kwargs", {"use_reentrant": True, "debug": True}),
        # beyond what the generators take, and a 1 / temperature that is no normal float32 (an outside audit,
        # 2026-11-29: each failed after the model loaded, in numpy's or the op's words)
        ("seed", 2**32), ("seed", 10**20), ("temperature", 1e-39), ("temperature", 1e39),
    ],
)  # fmt: skip
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field} "):
        GRPOConfig(**{field: value})


#: An out-of-range value of every loss option GRPOConfig carries (docs/math.md sections 3-5).
LOSS_OPTION_CASES = [
    ("loss_type", "ppo"), ("kl_estimator", "k4"), ("importance_sampling_level", "sentence"),
    ("epsilon", -0.1), ("epsilon", float("nan")), ("epsilon_high", -0.1), ("epsilon_high", float("nan")),
    ("delta", 1.0), ("delta", 0.5), ("delta", float("nan")), ("beta", -0.1), ("beta", float("inf")),
    ("beta", float("nan")), ("max_completion_length", 0),
    *[(name, value) for name in ("sapo_temperature_pos", "sapo_temperature_neg")
      for value in (-1.0, 0.0, float("nan"), float("inf"))],
    *[(name, value) for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
      for value in (float("nan"), float("inf"), float("-inf"))],
]  # fmt: skip


def test_loss_option_cases_cover_every_loss_option_of_the_config():
    carried = {f.name for f in dataclasses.fields(GRPOConfig)} & set(LossOptions._fields)
    assert {name for name, _ in LOSS_OPTION_CASES} == carried


@pytest.mark.parametrize(("field", "value"), LOSS_OPTION_CASES)
def test_config_refuses_out_of_range_loss_options_as_the_loss_does(field, value):
    """At construction, before a model loads; with the loss's own check (one definition of the ranges)."""
    with pytest.raises(ValueError, match=rf"^GRPOConfig\.{field} ") as config_error:
        GRPOConfig(**{field: value})
    logps = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{field} ") as loss_error:
        grpo_ext.grpo_loss(logps, torch.ones(2), torch.ones(2, 3), ref_logps=logps, **{field: value})
    assert str(config_error.value) == f"GRPOConfig.{loss_error.value}"


def test_config_expands_a_home_output_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert GRPOConfig(output_dir="~/runs/a").output_dir == str(tmp_path / "runs" / "a")
    assert GRPOConfig(seed=2**32 - 1, temperature=1e-38).seed == 2**32 - 1  # the bounds themselves are taken


def test_config_generation_batch_must_hold_whole_groups():
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_generations .* 12"):
        GRPOConfig(num_generations=8, per_device_train_batch_size=6, steps_per_generation=2)
    assert (
        GRPOConfig(num_generations=4, per_device_train_batch_size=6, steps_per_generation=2).generation_batch_size == 12
    )


def test_config_defaults_and_unknown_keys():
    config = GRPOConfig(gradient_accumulation_steps=3, num_generations=3, per_device_train_batch_size=3)
    assert config.steps_per_generation == 3
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match=r"no field 'learning_rat' \(did you mean 'learning_rate'\?\)"):
        GRPOConfig.from_dict({"learning_rat": 1e-3})
    assert GRPOConfig(epsilon=0.0, epsilon_high=0.28).epsilon == 0.0  # a zero lower clip range is legitimate


def test_trainer_checks_reward_weights_length(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1"):
        make_trainer(small_config(tmp_path, reward_weights=[1.0, 2.0]))


def test_package_exports_are_lazy():
    assert grpo_ext.GRPOConfig is GRPOConfig
    assert grpo_ext.GRPOTrainer is GRPOTrainer
    assert {"GRPOConfig", "GRPOTrainer"} <= set(grpo_ext.__all__)
