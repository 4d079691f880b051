"""The trainer's fused path (logps_backend="fused": the loss and log-probs from hidden states) against the plain path
(the model's logits, selective_log_softmax, grpo_loss) on tiny random-init models of each architecture family, its
fallbacks, and that it never forms the [B, T, V] logits."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_ext.ops import lm_head as lm_head_module
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.policy_logps import fused_policy_loss, fused_refusal, logits_transform
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import small_config, step_loss_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 24  # != the vocabulary (16): a tensor whose last dimension is 16 holds logits

# Each family: its config class and options (tiny: one layer, hidden 24, two heads of 12).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_head_bias": ("LlamaConfig", "LlamaForCausalLM", {}),  # the LM head replaced by one with a bias
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12)),
    "gemma_tied": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=12, tie_word_embeddings=True)),
    "gemma2_no_softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=12, final_logit_softcapping=None)),
    # a cap small enough to bend these tiny logits (Gemma 2's own is 30): the kernels' logit_softcap
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=12, final_logit_softcapping=0.5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=12, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt2_tied": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=HIDDEN, n_layer=1, n_head=2, n_positions=32)),
    "cohere_scale_1": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=1.0)),
    "cohere_scale": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=3.0)),  # the kernels' logit_scale
}


def build_family(name: str, tokenizer, **overrides) -> torch.nn.Module:
    config_name, model_name, options = FAMILIES[name]
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    if model_name == "GPT2LMHeadModel":
        sizes = {}
    else:
        sizes = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **sizes, **ids, **{**options, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    if name == "llama_head_bias":
        model.lm_head = torch.nn.Linear(HIDDEN, len(tokenizer), bias=True)
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    return model


def family_trainer(tmp_path, model: torch.nn.Module, backend: str, **overrides) -> GRPOTrainer:
    options = dict(max_steps=3, beta=0.04, num_iterations=2, loss_type="dapo", adam_epsilon=1e-3,
                   per_device_train_batch_size=8, logps_backend=backend)  # fmt: skip
    options.update(overrides)
    tokenizer = build_tokenizer()
    rows, _ = reversal_dataset(seed=0)
    return GRPOTrainer(model, [reversal_reward], rows, small_config(tmp_path / backend, **options), tokenizer=tokenizer)


def assert_training_equal(tmp_path, family: str, **overrides) -> None:
    """3 training steps on the fused and on the plain path: the same metrics and parameters to float32 rounding."""
    tokenizer = build_tokenizer()
    runs = {}
    for backend in ("fused", "plain"):
        model = build_family(family, tokenizer)
        trainer = family_trainer(tmp_path, model, backend, **overrides)
        assert trainer.policy_fused == (backend == "fused") and trainer.ref_fused == (backend == "fused")
        history = trainer.train()
        runs[backend] = (history, {n: p.detach().clone() for n, p in model.named_parameters()})
    for fused_row, plain_row in zip(runs["fused"][0], runs["plain"][0], strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "reward"):
            assert fused_row[key] == pytest.approx(plain_row[key], rel=1e-5, abs=1e-6), key
    for name, value in runs["fused"][1].items():
        torch.testing.assert_close(value, runs["plain"][1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_training_equals_plain(tmp_path, family):
    """3 training steps (num_iterations=2, beta > 0), then the loss and gradients of a micro-batch: the fused path
    equals the plain path to float32 rounding, for each architecture family."""
    assert_training_equal(tmp_path, family)
    tokenizer = build_tokenizer()
    # The gradients of one micro-batch (old and reference log-probs from the queue), parameter by parameter.
    trainer = family_trainer(tmp_path / "grads", build_family(family, tokenizer), "fused")
    trainer._generate_and_score()
    fused_loss, fused_grads = step_loss_and_grads(trainer, fused=True)
    plain_loss, plain_grads = step_loss_and_grads(trainer, fused=False)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_training_equals_plain_sequence_level_with_accumulation(tmp_path):
    """GSPO's sequence-level ratios (two passes over the chunks), 2 micro-batches per step, temperature 0.7."""
    assert_training_equal(tmp_path, "qwen2_tied", loss_type="grpo", importance_sampling_level="sequence",
                          gradient_accumulation_steps=2, per_device_train_batch_size=4, temperature=0.7)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "transform"), [("cohere_scale", (3.0, None)), ("gemma2_softcap", (1.0, 0.5)), ("llama", (1.0, None))]
)
def test_logits_transforms_stay_fused(tmp_path, family, transform):
    """Cohere's logit scale and Gemma 2's soft-capping are read from the model and go through the fused kernels
    (logit_scale / logit_softcap): no fallback, no warning; test_fused_training_equals_plain checks the values."""
    model = build_family(family, build_tokenizer())
    assert logits_transform(model) == transform
    assert fused_refusal(model) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = family_trainer(tmp_path, model, "fused", beta=0.0)
    assert trainer.policy_fused


class DoubledLogits(transformers.LlamaForCausalLM):
    """A causal LM with a logits transform no attribute names."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class SameLogits(transformers.LlamaForCausalLM):
    """A subclass that leaves the logits alone (not in VERIFIED_CAUSAL_LMS: probed)."""


def test_unknown_logits_transform_falls_back_with_a_warning(tmp_path):
    tokenizer = build_tokenizer()
    config = build_model(tokenizer).config
    torch.manual_seed(0)
    assert fused_refusal(SameLogits(config)) is None  # the probe finds the head's logits
    with pytest.warns(UserWarning, match=r"DoubledLogits\) falls back .*unknown logits transform"):
        trainer = family_trainer(tmp_path, DoubledLogits(config), "fused", beta=0.0)
    assert not trainer.policy_fused


class LargestLogits(TorchDispatchMode):
    """Records the largest tensor an op (not a view: ``W.t()`` is [H, V]) returns whose last dimension is V."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_step_never_forms_the_logits(tmp_path, monkeypatch):
    """With 4-row chunks, no op of a fused training step or of the old and reference log-probs returns more than 4
    rows of logits, and no LM head module runs; the plain path forms the [B, Lp + T, V] logits."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    monkeypatch.setattr(lm_head_module, "LOGITS_CHUNK_BYTES", 4 * vocab * 4)  # 4 float32 rows per chunk
    # the loss' chunks under CUDA's rule (on a CPU they may grow to the [V, H] weight gradient's size)
    monkeypatch.setattr(lm_head_module, "hidden_chunk_budget", lambda *_: lm_head_module.LOGITS_CHUNK_BYTES)
    largest, head_calls = {}, []
    for backend in ("fused", "plain"):
        trainer = family_trainer(tmp_path, build_family("llama", tokenizer), backend, max_steps=1)
        trainer._generate_and_score()  # generation runs the LM head; queues the micro-batches
        head_calls.clear()
        for scored in (trainer.model, trainer.ref_model):
            scored.lm_head.register_forward_hook(lambda *_, tag=backend: head_calls.append(tag))
        mb = trainer._micro_batches[0]
        with LargestLogits(vocab) as mode:
            trainer._training_step()
            for scored in (trainer.model, trainer.ref_model):
                trainer.token_logps(scored, mb)
        largest[backend] = mode.largest
    assert "fused" not in head_calls and "plain" in head_calls
    assert largest["fused"] <= 4 * vocab
    batch, full_length = mb["completion_ids"].shape[0], mb["prompt_ids"].shape[1] + mb["completion_ids"].shape[1]
    assert largest["plain"] >= batch * full_length * vocab


def test_sapo_and_vespo_options_reach_the_loss(tmp_path, monkeypatch):
    """GRPOConfig's sapo_temperature_* and vespo_* (TRL's names) are passed to the loss, not left at their defaults;
    one vespo step trains (finite loss)."""
    from grpo_ext.trainer import trainer as trainer_module

    seen = []

    def spy(*args, **options):
        seen.append(options)
        return fused_policy_loss(*args, **options)

    monkeypatch.setattr(trainer_module, "fused_policy_loss", spy)
    values = dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, vespo_k_pos=1.5, vespo_lambda_pos=0.6,
                  vespo_k_neg=3.0, vespo_lambda_neg=1.1)  # fmt: skip
    trainer = family_trainer(tmp_path, build_family("llama", build_tokenizer()), "fused", max_steps=1,
                             loss_type="vespo", **values)  # fmt: skip
    history = trainer.train()
    assert seen and all(options[k] == v for options in seen for k, v in values.items())
    assert seen[0]["loss_type"] == "vespo" and torch.isfinite(torch.tensor(history[0]["loss"]))


def test_entropy_bonus_fused_equals_plain_and_torch(tmp_path):
    """GRPOConfig.entropy_coef over 2 micro-batches per step: the fused kernels' bonus, the plain path's (the entropy
    of selective_log_softmax, differentiated) and the torch path's (log_softmax, differentiated by autograd) give the
    same metrics and parameters, and the bonus does change the run."""
    tokenizer = build_tokenizer()
    overrides = dict(entropy_coef=0.5, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    runs = {}
    for backend, coef in (("fused", 0.5), ("plain", 0.5), ("torch", 0.5), ("fused", 0.0)):
        model = build_family("llama", tokenizer)
        trainer = family_trainer(tmp_path / f"{backend}-{coef}", model, backend, **{**overrides, "entropy_coef": coef})
        runs[backend, coef] = (trainer.train(), {n: p.detach().clone() for n, p in model.named_parameters()})
    fused = runs["fused", 0.5]
    for other in (runs["plain", 0.5], runs["torch", 0.5]):
        for row, other_row in zip(fused[0], other[0], strict=True):
            for key in ("loss", "grad_norm", "kl", "entropy", "reward"):
                assert row[key] == pytest.approx(other_row[key], rel=1e-5, abs=1e-6), key
        for name, value in fused[1].items():
            torch.testing.assert_close(value, other[1][name], rtol=1e-5, atol=1e-6, msg=name)
    without = runs["fused", 0.0]
    assert fused[0][0]["loss"] != pytest.approx(without[0][0]["loss"], rel=1e-3)
    assert any(not torch.allclose(value, without[1][name]) for name, value in fused[1].items())


def test_entropy_coef_must_be_a_finite_number(tmp_path):
    for bad in (float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"GRPOConfig\.entropy_coef"):
            small_config(tmp_path, entropy_coef=bad)
