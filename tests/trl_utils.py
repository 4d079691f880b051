"""Helpers of the TRL integration tests (tests/test_trl_integration.py, tests/test_trl_patching.py,
tests/test_trl_distributed.py and its child process): tiny models saved to a folder, TRL trainers on them, a
hand-built batch, the comparisons of a patched ``compute_loss`` with TRL's own, and the fixtures that build them.

Importing this module skips the importing test module when trl is missing or unsupported (it fails instead when
``GRPO_EXT_REQUIRE_TRL=1``, as ``make test`` sets; ``GRPO_EXT_REQUIRE_TRL_VERSION=1.14.0`` also fails it unless that
exact TRL is installed, as in the ``make test`` runs of the extra TRL releases).

TRL releases differ in how they score log-probs (python/grpo_ext/integrations/trl/compat.py); the tests run each
release's own path, with two stand-ins where that path cannot run on a CPU:

- TRL 1.14 scores from full logits unless ``use_liger_kernel=True``, which also patches the model with Liger's Triton
  kernels: :func:`make_trainer` switches ``GRPOTrainer``'s chunked path on (the attribute it reads) without Liger.
- TRL 1.15's chunked head (``trl/kernels/chunked_logprob.py``) folds its tiles in Triton only, on CUDA/XPU tensors:
  its one slot, ``trl.trainer.utils._ChunkedLogProbFunction``, holds :class:`Float64Head` (checked against TRL's own
  head in the runs where that head runs on a CPU) for TRL's reference runs.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from packaging.version import Version

# `make test` installs trl in its venv and sets this: there a missing or unsupported trl fails instead of skipping.
REQUIRE_TRL = os.environ.get("GRPO_EXT_REQUIRE_TRL") == "1"
if REQUIRE_TRL:
    import trl
else:
    trl = pytest.importorskip("trl")

import grpo_ext  # noqa: E402
from grpo_ext.integrations import trl as grpo_trl  # noqa: E402
from grpo_ext.integrations.trl import loss as grpo_trl_loss  # noqa: E402
from grpo_ext.trainer.demo import build_tokenizer  # noqa: E402

try:
    grpo_trl.check_trl_version()
except RuntimeError as exc:  # pragma: no cover - CI pins the supported trl
    if REQUIRE_TRL:
        raise
    pytest.skip(str(exc), allow_module_level=True)

REQUIRED_TRL_VERSION = os.environ.get("GRPO_EXT_REQUIRE_TRL_VERSION")
if REQUIRED_TRL_VERSION and trl.__version__ != REQUIRED_TRL_VERSION:
    raise RuntimeError(
        f"GRPO_EXT_REQUIRE_TRL_VERSION={REQUIRED_TRL_VERSION} but this environment has trl {trl.__version__} "
        f"({trl.__file__})"
    )
TRL_RELEASE = Version(trl.__version__).release[:2]
# TRL 1.16 hands its head every shifted position off Triton devices; 1.14's chunked path and 1.15 only the labelled
HEAD_SCORES_EVERY_POSITION = TRL_RELEASE == (1, 16)


class Float64Head:
    """TRL 1.15/1.16's ``_ChunkedLogProbFunction`` contract in plain torch, the log-softmax in float64 (autograd
    gives the gradients): the projection in the autocast dtype, then scale, soft-cap, temperature."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs",)):  # fmt: skip
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            logits = hidden.to(dtype) @ weight.to(dtype).t()
            if bias is not None:
                logits = logits + bias.to(dtype)
        z = logits.double() * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        log_p = (z / temperature).log_softmax(-1)
        logps = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        entropy = -(log_p.exp() * log_p).sum(-1).float() if "entropy" in outputs else None
        return logps, entropy, None, None, None


if TRL_RELEASE == (1, 15):
    import trl.trainer.utils as trl_trainer_utils

    trl_trainer_utils._ChunkedLogProbFunction = Float64Head

from datasets import Dataset  # noqa: E402  (a dependency of trl)

CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
B, P, T = 8, 4, 6  # completions (2 prompts x G=4), prompt length, completion length
LENGTHS = (6, 1, 3, 0, 6, 5, 2, 4)  # one empty row, one full row, one single-token row
ADVANTAGES = (1.2, -0.8, 0.5, -1.5, 0.9, -0.3, 1.1, -0.6)  # both signs, so every clip condition can occur


def save_model(path, tokenizer, arch: str = "llama", **config_extra: Any) -> str:
    """Saves a randomly initialized 2-layer causal LM (hidden 32) over the tokenizer's vocabulary; returns the path."""
    import transformers

    common = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    common.update(config_extra)
    if arch == "llama":  # untied LM head, no bias
        model_cls, config = (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common),
        )
    elif arch == "qwen2_tied":  # LM head tied to the embeddings
        model_cls, config = (
            transformers.Qwen2ForCausalLM,
            transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        )
    elif arch == "phi":  # LM head with a bias
        model_cls, config = transformers.PhiForCausalLM, transformers.PhiConfig(**common)
    elif arch == "mixtral":  # MoE: TRL adds the router load-balancing loss
        model_cls, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.02, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    return str(path)


def digit_reward(prompts, completions, **columns) -> list[float]:
    return [float(sum(ch == "1" for ch in c)) for c in completions]


def make_trainer(model_dir: str, tokenizer, tmp_path, cls=None, chunked: bool = True, **overrides: Any):
    """A TRL trainer in train mode, as inside its loop: 2 accumulation steps, 4 micro-batches per generation.

    ``chunked``: under TRL 1.14, take its chunked log-prob path (``use_liger_kernel``, without Liger's kernels);
    False keeps its default full-logits path. Later releases have only the fused head.
    """
    options = dict(
        output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, seed=1, per_device_train_batch_size=B,
        num_generations=4, max_completion_length=T, gradient_accumulation_steps=2, steps_per_generation=4,
        save_strategy="no", logging_steps=1, disable_tqdm=True, bf16=False,  # TRL defaults to bf16 autocast
    )  # fmt: skip
    options.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["12>", "345>"]})
    trainer = (cls or trl.GRPOTrainer)(
        model=model_dir, reward_funcs=digit_reward, args=trl.GRPOConfig(**options), train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    if TRL_RELEASE == (1, 14) and chunked:
        from trl.models.utils import _ForwardRedirection

        trainer.use_liger_kernel, trainer._forward_redirection = True, _ForwardRedirection()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by transformers' loop, read by TRL's loss
    return trainer


def make_inputs(trainer, *, seed: int = 0, old: bool = True, token_advantages: bool = False,
                tool_mask: bool = False, is_ratio_shape: tuple[int, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """TRL's ``compute_loss`` batch by hand: left-padded prompts, ragged completions, ratios straddling the clips."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = trainer.processing_class.pad_token_id
    completion_ids = torch.randint(4, vocab, (B, T), generator=g)
    completion_mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    advantages = torch.tensor(ADVANTAGES)
    if token_advantages:
        advantages = advantages[:, None] * (0.5 + torch.rand(B, T, generator=g))
    inputs: dict[str, Any] = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=advantages, num_items_in_batch=completion_mask.sum() * 4,
    )  # fmt: skip
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T
        )
    # A per-row shift as well as per-token noise, so sequence-level ratios leave the clip range too.
    drift = 0.3 * torch.randn(B, 1, generator=g) + 0.35 * torch.randn(B, T, generator=g)
    if old:
        inputs["old_per_token_logps"] = logps - drift
    inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=g)
    if tool_mask:
        inputs["tool_mask"] = (torch.rand(B, T, generator=g) > 0.3).long()
    if is_ratio_shape is not None:  # TRL's ratio is exactly 1 on padding (its log-ratio there is masked to 0)
        ratio = 0.5 + torch.rand(*is_ratio_shape, generator=g)
        if ratio.shape[1] == T:
            ratio = ratio.masked_fill(completion_mask == 0, 1.0)
        inputs["importance_sampling_ratio"] = ratio
    return inputs


@dataclasses.dataclass
class Calls:
    grpo_loss: int = 0
    grpo_loss_from_hidden: int = 0
    selective_log_softmax: int = 0


# The fixtures of tests/test_trl_integration.py and tests/test_trl_patching.py, which import them (the functions'
# names differ from the fixtures', so that a test's parameter does not shadow an import).
@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture():
    return build_tokenizer()


@pytest.fixture(scope="module", name="llama_dir")
def llama_dir_fixture(tmp_path_factory, tokenizer) -> str:
    return save_model(tmp_path_factory.mktemp("llama"), tokenizer)


@pytest.fixture(name="grpo_ext_calls")
def grpo_ext_calls_fixture(monkeypatch) -> Calls:
    """Counts the grpo_ext ops the integration calls (so a patch that did nothing cannot pass a parity test)."""
    calls = Calls()

    def spy(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            setattr(calls, name, getattr(calls, name) + 1)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(grpo_ext.ops, "grpo_loss", spy("grpo_loss", grpo_ext.ops.grpo_loss))
    monkeypatch.setattr(
        grpo_ext.ops, "grpo_loss_from_hidden", spy("grpo_loss_from_hidden", grpo_ext.ops.grpo_loss_from_hidden)
    )
    monkeypatch.setattr(
        grpo_ext.ops, "selective_log_softmax", spy("selective_log_softmax", grpo_ext.ops.selective_log_softmax)
    )
    return calls


def loss_and_grads(trainer, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """One ``compute_loss`` + backward from zero gradients: the loss, every parameter gradient, the metrics logged."""
    mode = "train" if trainer.model.training else "eval"
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics[mode].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {name: values[-1] for name, values in trainer._metrics[mode].items()}
    return loss.detach(), grads, metrics


def assert_same(expected, actual, tol: float = 1e-5) -> None:
    """Same loss, same gradient on every parameter, same metrics (relative to each tensor's scale)."""
    (loss0, grads0, metrics0), (loss1, grads1, metrics1) = expected, actual
    torch.testing.assert_close(loss1, loss0, rtol=tol, atol=tol * max(loss0.abs().item(), 1e-3))
    assert grads1.keys() == grads0.keys()
    assert any(g.abs().max() > 0 for g in grads0.values()), "no gradient reached the model: a vacuous comparison"
    for name, g0 in grads0.items():
        scale = max(g0.abs().max().item(), 1e-6)
        torch.testing.assert_close(grads1[name], g0, rtol=tol, atol=tol * scale, msg=lambda m, n=name: f"{n}: {m}")
    assert metrics1.keys() == metrics0.keys()
    for name, value in metrics0.items():
        assert metrics1[name] == pytest.approx(value, rel=tol, abs=tol), name


def compare(trainer, inputs, calls: Calls, tol: float = 1e-5, backend: str = "fused",
            fallback: str | None = None) -> dict[str, float]:  # fmt: skip
    """TRL's compute_loss, then the patched one on the same parameters and inputs; returns TRL's metrics.

    The patched run must take the fused path (grpo_loss_from_hidden, no log-prob pass for the loss) for
    ``backend="fused"``, unless ``fallback`` names the warning it must give instead of taking it.
    """
    before = entropy_control_state(trainer)
    expected = loss_and_grads(trainer, inputs)
    after_trl = entropy_control_state(trainer)
    assert calls.grpo_loss == calls.grpo_loss_from_hidden == calls.selective_log_softmax == 0
    restore_entropy_control_state(trainer, before)
    grpo_trl.patch(trainer, logps_backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = loss_and_grads(trainer, inputs)
    fallbacks = [str(w.message) for w in caught if "falls back to the log-prob path" in str(w.message)]
    if backend == "fused" and fallback is None:
        assert not fallbacks
        assert calls.grpo_loss_from_hidden == 1 and calls.grpo_loss == 0
        # no log-prob pass but the no-grad one that TRL's masks need before the loss: the clip metrics' per-token
        # ratios come from the fused pass' own log-probs
        if grpo_trl_loss._needs_token_values(trainer):
            assert calls.selective_log_softmax >= 1
        else:
            assert calls.selective_log_softmax == 0
    else:
        assert len(fallbacks) == (0 if fallback is None else 1) and (fallback or "") in "".join(fallbacks)
        assert calls.grpo_loss == 1 and calls.grpo_loss_from_hidden == 0 and calls.selective_log_softmax >= 1
    assert_same(expected, actual, tol)
    assert_same_entropy_control(after_trl, entropy_control_state(trainer), tol)
    return expected[2]


def entropy_control_state(trainer) -> dict[str, Any]:
    """TRL's entropy-bonus controller: the coefficient, the last optimizer step's entropy, the window's sums."""
    window = trainer._entropy_window_stats
    return dict(entropy_coef=trainer.entropy_coef, last=trainer._last_world_entropy,
                window=None if window is None else window.clone())  # fmt: skip


def restore_entropy_control_state(trainer, state: dict[str, Any]) -> None:
    trainer.entropy_coef, trainer._last_world_entropy = state["entropy_coef"], state["last"]
    trainer._entropy_window_stats = None if state["window"] is None else state["window"].clone()


def assert_same_entropy_control(expected: dict[str, Any], actual: dict[str, Any], tol: float) -> None:
    assert actual["entropy_coef"] == pytest.approx(expected["entropy_coef"], rel=tol, abs=tol)
    assert actual["last"] == pytest.approx(expected["last"], rel=tol, abs=tol)
    assert (actual["window"] is None) == (expected["window"] is None)
    if expected["window"] is not None:
        torch.testing.assert_close(actual["window"], expected["window"], rtol=tol, atol=tol)


def assert_same_training(reference, ours, keys: tuple[str, ...], param_atol: float = 1e-6) -> list[dict]:
    """Two trainers' logged steps agree on ``keys``, and so do their parameters; returns the reference's log rows."""
    logs0 = [row for row in reference.state.log_history if "loss" in row]
    logs1 = [row for row in ours.state.log_history if "loss" in row]
    assert len(logs0) == len(logs1) == 2
    for row0, row1 in zip(logs0, logs1, strict=True):
        for key in keys:
            assert row1[key] == pytest.approx(row0[key], rel=1e-4, abs=1e-6), key
    params0 = dict(reference.model.named_parameters())
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p, params0[name], rtol=1e-4, atol=param_atol)
    return logs0
