"""A peft LoRA model in the trainer: the fused path (the loss from hidden states, grpo_loss_from_hidden) against the
plain path (the model's logits), the adapters it refuses with a warning, and a LoRA run's checkpoint and resume."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import grpo_ext
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.policy_logps import fused_refusal
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import AttentionCalls, read_metrics, small_config, step_loss_and_grads, without_timing

# `make test` installs peft in its venv and sets this: there a missing peft fails instead of skipping.
if os.environ.get("GRPO_EXT_REQUIRE_TRL") == "1":
    import peft
else:
    peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # peft reads transformers' deprecated is_gradient_checkpointing when it wraps a model
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model() -> torch.nn.Module:
    """A tiny random LLaMA: hidden 24, one layer, two heads, the demo's 16 tokens."""
    return build_model(build_tokenizer(), hidden_size=24, num_layers=1, num_heads=2)


def lora_model(targets=PROJECTIONS, lora_seed: int = 1, moved_b: bool = True, **lora_options) -> torch.nn.Module:
    """:func:`base_model` with LoRA adapters on ``targets``; ``lora_seed`` draws their init. With ``moved_b`` the
    ``B`` matrices (peft's init: zero) are drawn too, so that both factors reach the logits and get gradients."""
    base = base_model()
    torch.manual_seed(lora_seed)
    options = dict(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(base, peft.LoraConfig(**{**options, **lora_options}))
    if moved_b:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)
    return model


def prompt_tuning_model() -> torch.nn.Module:
    return peft.get_peft_model(base_model(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))


def lora_trainer(tmp_path, model: torch.nn.Module, backend: str, **overrides) -> GRPOTrainer:
    options = dict(max_steps=3, beta=0.04, num_iterations=2, loss_type="dapo", adam_epsilon=1e-3,
                   per_device_train_batch_size=16, logps_backend=backend)  # fmt: skip
    options.update(overrides)
    rows, _ = reversal_dataset(seed=0)
    return GRPOTrainer(model, [reversal_reward], rows, small_config(tmp_path, **options), tokenizer=build_tokenizer())


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "falls back to the plain path" in str(w.message)]


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("targets", [PROJECTIONS, [*PROJECTIONS, "lm_head"]], ids=["projections", "with_lm_head"])
def test_lora_fused_training_equals_plain(tmp_path, monkeypatch, targets):
    """A LoRA model (attention and MLP projections; with the LM head too) trains on the fused path, through
    grpo_loss_from_hidden and with no fallback warning; 3 steps (num_iterations=2, beta > 0) give the plain path's
    metrics and LoRA parameters, one micro-batch its loss and every LoRA gradient, to float32 rounding."""
    hidden_calls = []
    original = grpo_ext.ops.grpo_loss_from_hidden  # the trainer calls the ops (below the package's facade)
    spy = lambda *a, **k: hidden_calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(grpo_ext.ops, "grpo_loss_from_hidden", spy)
    runs = {}
    for backend in ("fused", "plain"):
        model = lora_model(targets)
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer = lora_trainer(tmp_path / backend, model, backend)
        assert fallback_warnings(record) == []
        assert trainer.policy_fused == trainer.ref_fused == (backend == "fused")
        hidden_calls.clear()
        history = trainer.train()
        assert len(hidden_calls) == (3 if backend == "fused" else 0)  # one loss per step, none on the plain path
        runs[backend] = history, trainable(model)
        assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # the base: frozen
    lora_names = set(runs["fused"][1])
    assert lora_names and all("lora_" in name for name in lora_names)
    assert any("lm_head" in name for name in lora_names) == ("lm_head" in targets)
    for fused_row, plain_row in zip(runs["fused"][0], runs["plain"][0], strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "reward"):
            assert fused_row[key] == pytest.approx(plain_row[key], rel=1e-5, abs=1e-6), key
    initial = trainable(lora_model(targets))
    for name, value in runs["fused"][1].items():
        assert not torch.equal(value, initial[name]), name  # trained: the comparison is not of two initial copies
        torch.testing.assert_close(value, runs["plain"][1][name], rtol=1e-5, atol=1e-6, msg=name)

    # One micro-batch (old and reference log-probs from the queue): the loss and each LoRA parameter's gradient.
    trainer = lora_trainer(tmp_path / "grads", lora_model(targets), "fused")
    trainer._generate_and_score()
    results = {fused: step_loss_and_grads(trainer, fused) for fused in (True, False)}
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-7)
    assert results[True][1].keys() == results[False][1].keys() == lora_names
    for name, grad in results[True][1].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, results[False][1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("backend", "kwargs"),
    [("fused", None), ("plain", None), ("fused", {"use_reentrant": True})],
    ids=["fused", "plain", "fused_reentrant"],
)
def test_lora_gradient_checkpointing_recomputes_and_gives_the_same_step(tmp_path, backend, kwargs):
    """LoRA (the projections and the LM head) under gradient checkpointing, float64: one optimizer step's update of
    every adapter equals the step without it to 1e-12, and the layer's attention runs twice in the step (the
    recompute). Reentrant checkpointing reaches the adapters only because the embeddings' output requires grad."""
    runs = {}
    for on in (False, True):
        model = lora_model([*PROJECTIONS, "lm_head"]).double()
        trainer = lora_trainer(tmp_path / str(on), model, backend, warmup_steps=0, gradient_checkpointing=on,
                               gradient_checkpointing_kwargs=kwargs)  # fmt: skip
        assert trainer.policy_fused == (backend == "fused")
        before = trainable(model)
        trainer._generate_and_score()
        calls = AttentionCalls(model)
        metrics = trainer._training_step()
        calls.remove()
        assert calls.counts == ([2] if on else [1])
        runs[on] = metrics, {name: value - before[name] for name, value in trainable(model).items()}
    assert runs[True][0]["grad_norm"] == pytest.approx(runs[False][0]["grad_norm"], rel=1e-12)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, update in runs[False][1].items():
        assert update.abs().max() > 0, name  # every adapter moved
        torch.testing.assert_close(runs[True][1][name], update, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: lora_model([*PROJECTIONS, "lm_head"], lora_dropout=0.1), r"LoRA adapter 'default' has dropout"),
        (lambda: lora_model([*PROJECTIONS, "lm_head"], use_dora=True), r"is a variant \(DoRA"),
        (lambda: lora_model(PROJECTIONS, modules_to_save=["lm_head"]), r"are ModulesToSaveWrapper, not a torch"),
        (prompt_tuning_model, r"adapter \(PROMPT_TUNING\) adds virtual tokens"),
        (lambda: lora_model(PROJECTIONS, alora_invocation_tokens=[14], task_type="CAUSAL_LM"), r"an activated LoRA"),
    ],
    ids=["lm_head_dropout", "lm_head_dora", "lm_head_modules_to_save", "prompt_tuning", "activated_lora"],
)
def test_adapters_the_fused_path_cannot_score_fall_back_with_a_warning(tmp_path, make, reason):
    """A LoRA LM head with dropout or DoRA, a fully trained (modules_to_save) head, prompt tuning and activated LoRA
    (what peft applies in its own forward): the plain path, with a warning naming the reason; LoRA dropout inside the
    body stays on the fused path."""
    model = make()
    assert fused_refusal(model) is not None
    with pytest.warns(UserWarning, match=r"\(PeftModel.*\) falls back to the plain path: .*" + reason):
        trainer = lora_trainer(tmp_path, model, "fused", beta=0.0)
    assert not trainer.policy_fused
    assert fused_refusal(lora_model(PROJECTIONS, lora_dropout=0.1)) is None


def test_lora_checkpoint_saves_the_adapter_and_resumes_exactly(tmp_path):
    """A LoRA run's checkpoint holds peft's adapter files and, in model_state.pt, the adapter alone (not the frozen
    base); a fresh model with another LoRA init resumes from it to the uninterrupted run's metrics and parameters,
    bit for bit. A model with another LoRA config is refused, naming the mismatch."""
    # peft's init (B = 0): the reference model is the base model whatever the LoRA seed, as in a real run
    options = dict(max_steps=4, save_steps=2, learning_rate=1e-2)
    trainer = lora_trainer(tmp_path, lora_model(moved_b=False), "fused", **options)
    trainer.train()
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out, checkpoint = tmp_path / "run", tmp_path / "run" / "checkpoint-2"
    rows = read_metrics(out / "metrics.jsonl")
    for name in ("adapter_config.json", "adapter_model.safetensors", "model_state.pt", "trainer_state.pt"):
        assert (checkpoint / name).is_file(), name
    saved = torch.load(checkpoint / "model_state.pt", weights_only=False)
    assert saved["adapter_only"] and saved["model"].keys() == trainable(trainer.model).keys()

    # The adapter files load with peft into a fresh base model: the LoRA weights of step 2, the ones resumed below.
    loaded = peft.PeftModel.from_pretrained(base_model(), checkpoint)
    loaded_lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert loaded_lora.keys() == saved["model"].keys()
    for name, value in loaded_lora.items():
        assert torch.equal(value, saved["model"][name]), name

    fresh = lora_model(lora_seed=2, moved_b=False)  # another init: only the checkpoint can give step 4's weights
    first_init = trainable(lora_model(moved_b=False))
    assert any(not torch.equal(p, first_init[n]) for n, p in trainable(fresh).items())
    resumed = lora_trainer(tmp_path, fresh, "fused", **options)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.global_step == 4
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, final[name]), name
    resumed_rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed_rows] == [1, 2, 3, 4]
    assert [without_timing(r) for r in resumed_rows] == [without_timing(r) for r in rows]

    other = lora_trainer(tmp_path, lora_model(PROJECTIONS[:4], moved_b=False), "fused", **options)  # attention only
    with pytest.raises(ValueError, match=r"adapter does not match the model's .*missing \[\] \(0\), unexpected "
                                         r"\['base_model\.model\.model\.layers\.0\.mlp\.down_proj"):  # fmt: skip
        other.train(resume_from_checkpoint=str(checkpoint))
    # The same modules with another scaling or rank would train another adapter: refused, naming the options (an
    # outside audit, 2026-11-29: lora_alpha 8 -> 64 resumed silently; r 4 -> 8 failed in load_state_dict's words)
    for changed, message in ((dict(lora_alpha=64), r"lora_alpha: 8 -> 64"), (dict(r=8), r"r: 4 -> 8"),
                             (dict(r=8, lora_alpha=16), r"lora_alpha: 8 -> 16; r: 4 -> 8")):  # fmt: skip
        other = lora_trainer(tmp_path, lora_model(moved_b=False, **changed), "fused", **options)
        with pytest.raises(ValueError, match=rf"lora: the checkpoint's adapter .* has another config than this "
                                             rf"run's \({message}\): resume with the same lora options"):  # fmt: skip
            other.train(resume_from_checkpoint=str(checkpoint))


def test_a_lora_run_leaves_its_adapter_alone_as_the_final_model(tmp_path):
    """The final model of a LoRA run is peft's adapter (no base weights); the base model plus that adapter gives the
    trained model's LoRA weights and logits exactly."""
    from safetensors.torch import load_file

    trainer = lora_trainer(tmp_path, lora_model(moved_b=False), "fused", learning_rate=1e-2)
    initial = trainable(lora_model(moved_b=False))
    trainer.train()
    final = tmp_path / "run" / "final_model"
    assert trainer.final_model_path == final
    saved = load_file(final / "adapter_model.safetensors")
    assert len(saved) == len(initial) and all("lora_" in name for name in saved)  # the adapter alone
    assert not [p.name for p in final.iterdir() if p.name.startswith(("model", "pytorch_model"))]
    assert (final / "tokenizer.json").is_file()

    loaded = peft.PeftModel.from_pretrained(base_model(), final)
    trained = trainable(trainer.model)
    assert any(not torch.equal(value, initial[name]) for name, value in trained.items())  # it did train
    loaded_lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert loaded_lora.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded_lora[name], value), name
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 12, 2]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, trainer.model(ids).logits)
