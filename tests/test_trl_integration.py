"""grpo_ext.integrations.trl: TRL's own GRPOTrainer, unpatched and patched, gives the same loss, gradients, metrics.

Every trainer here is a real ``trl.GRPOTrainer`` on a tiny random model saved to a temporary folder (TRL loads the
policy, and the reference when ``beta != 0``, from that folder; nothing is downloaded). ``compute_loss`` runs on a
batch built by hand, once with TRL's own code and once patched, on the same parameters, in float32. The patched run
takes the fused path (grpo_loss_from_hidden) unless a test asks for ``logps_backend="plain"``. The trainer, batch and
comparison helpers and the fixtures are in tests/trl_utils.py (shared with tests/test_trl_patching.py, which checks
the patching itself, and tests/test_trl_distributed.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_ext
from grpo_ext.validation.options import LOSS_TYPES

# importing trl_utils skips this module when trl is missing or unsupported (fails with GRPO_EXT_REQUIRE_TRL=1)
from trl_utils import (
    CLIP_FAMILY,
    HEAD_SCORES_EVERY_POSITION,
    TRL_RELEASE,
    B,
    P,
    T,
    assert_same,
    assert_same_entropy_control,
    assert_same_training,
    compare,
    entropy_control_state,
    grpo_ext_calls_fixture,  # noqa: F401  (the fixtures)
    grpo_trl,
    llama_dir_fixture,  # noqa: F401
    loss_and_grads,
    make_inputs,
    make_trainer,
    save_model,
    tokenizer_fixture,  # noqa: F401
    trl,
)

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------------
# loss parity
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", grpo_trl.LOGPS_BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_patched_loss_and_gradients_match_trl(loss_type, beta, level, backend, llama_dir, tokenizer, tmp_path,
                                              grpo_ext_calls):  # fmt: skip
    trainer = make_trainer(
        llama_dir, tokenizer, tmp_path, loss_type=loss_type, beta=beta, importance_sampling_level=level
    )
    assert trainer.args.use_bias_correction_kl  # TRL's default, which grpo_ext's default (False) must not replace
    metrics = compare(trainer, make_inputs(trainer), grpo_ext_calls, backend=backend)
    # The batch must exercise what is compared: clipping happens, and the KL is there when beta != 0.
    if loss_type == "cispo":
        assert metrics["cispo_clip_ratio"] > 0
    elif loss_type == "vespo":  # weights away from 1, and no clip metric
        assert metrics["vespo/phi_seq_mean"] != pytest.approx(1.0)
        assert not any(name.startswith("clip_ratio") for name in metrics)
    elif loss_type in CLIP_FAMILY:
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    else:  # sapo: a soft gate, no clip metric
        assert not any(name.startswith("clip_ratio") for name in metrics)
    assert ("kl" in metrics) == (beta != 0) and metrics.get("kl", 1.0) > 0


@dataclasses.dataclass(frozen=True)
class Case:
    """A TRL option mapped onto a grpo_ext parameter: config overrides, trainer attributes, batch options."""

    config: dict = dataclasses.field(default_factory=dict)
    attrs: dict = dataclasses.field(default_factory=dict)
    inputs: dict = dataclasses.field(default_factory=dict)
    arch: str = "llama"
    model_config: dict = dataclasses.field(default_factory=dict)
    eval_mode: bool = False
    tol: float = 1e-5
    fallback: str | None = None  # the reason the fused path must give for not taking the loss


CASES = {
    "no_bias_correction": Case(config=dict(beta=0.04, use_bias_correction_kl=False, loss_type="grpo")),
    "dapo_asymmetric_delta": Case(config=dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, delta=1.5)),
    "cispo_cap_5": Case(config=dict(loss_type="cispo", epsilon_high=5.0)),
    # TRL applies delta to the clip family only: sapo, cispo and vespo ignore it, whatever its value (an outside
    # audit, 2026-11-29: these failed at the first step)
    "sapo_ignores_delta": Case(config=dict(loss_type="sapo", delta=1.0)),
    "cispo_ignores_delta": Case(config=dict(loss_type="cispo", delta=0.8)),
    "vespo_ignores_delta": Case(config=dict(loss_type="vespo", delta=0.5)),
    "sapo_temperatures": Case(config=dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3)),
    "dr_grpo_max_completion_length": Case(config=dict(loss_type="dr_grpo", max_completion_length=10)),
    "on_policy": Case(config=dict(loss_type="dapo", beta=0.04), inputs=dict(old=False)),
    "token_advantages": Case(config=dict(loss_type="grpo", beta=0.04), inputs=dict(token_advantages=True)),
    "tool_mask": Case(config=dict(loss_type="bnpo", beta=0.04), inputs=dict(tool_mask=True)),
    "vllm_is_token": Case(
        config=dict(loss_type="dapo", beta=0.04),
        attrs=dict(use_vllm=True, vllm_importance_sampling_correction=True),
        inputs=dict(is_ratio_shape=(B, T)),
    ),
    "vllm_is_sequence": Case(
        config=dict(loss_type="grpo", importance_sampling_level="sequence"),
        attrs=dict(use_vllm=True, vllm_importance_sampling_correction=True),
        inputs=dict(is_ratio_shape=(B, 1)),
    ),
    "vespo_vllm_is_token": Case(
        config=dict(loss_type="vespo", beta=0.04),
        attrs=dict(use_vllm=True, vllm_importance_sampling_correction=True),
        inputs=dict(is_ratio_shape=(B, T)),
    ),
    "vespo_params_token_advantages": Case(
        config=dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.7, vespo_k_neg=4.0, vespo_lambda_neg=1.2),
        inputs=dict(token_advantages=True),
    ),
    # TRL's masks from per-token values: a no-grad pass inside the forward, then the fused loss with them as weights
    "off_policy_mask": Case(config=dict(loss_type="dapo", beta=0.04, off_policy_mask_threshold=0.02)),
    "off_policy_mask_on_policy": Case(
        config=dict(loss_type="grpo", off_policy_mask_threshold=0.02), inputs=dict(old=False)
    ),
    "top_entropy_quantile": Case(config=dict(loss_type="grpo", top_entropy_quantile=0.5)),
    "top_entropy_quantile_sequence": Case(
        config=dict(loss_type="dapo", beta=0.04, top_entropy_quantile=0.2, importance_sampling_level="sequence")
    ),
    "both_masks_softcap": Case(
        config=dict(loss_type="bnpo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.02),
        model_config=dict(final_logit_softcapping=0.5),
    ),
    # vespo: the masks multiply its term after phi (policy_weights), the vLLM ratio enters phi (is_weights)
    "vespo_off_policy_mask": Case(config=dict(loss_type="vespo", beta=0.04, off_policy_mask_threshold=0.02)),
    "vespo_masks_vllm_is": Case(
        config=dict(loss_type="vespo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.02, entropy_coef=0.1),
        attrs=dict(use_vllm=True, vllm_importance_sampling_correction=True),
        inputs=dict(is_ratio_shape=(B, T)),
    ),
    "off_policy_mask_entropy_coef": Case(
        config=dict(loss_type="cispo", off_policy_mask_threshold=0.02, entropy_coef=0.1)
    ),
    # the logits options of the fused kernels (logit_softcap, logit_scale), TRL's order: scale, cap, temperature
    "softcap_model": Case(config=dict(loss_type="dapo", beta=0.04), model_config=dict(final_logit_softcapping=0.5)),
    "logit_scale_model": Case(config=dict(loss_type="grpo"), model_config=dict(logit_scale=0.7)),
    "phi_lm_head_bias": Case(config=dict(loss_type="grpo", beta=0.04), arch="phi"),
    "qwen2_tied_embeddings": Case(config=dict(loss_type="dapo", beta=0.04), arch="qwen2_tied"),
    "temperature": Case(config=dict(loss_type="grpo", beta=0.04, temperature=0.7)),
    "eval_dapo": Case(config=dict(loss_type="dapo", beta=0.04), eval_mode=True),
    "eval_grpo": Case(config=dict(loss_type="grpo", importance_sampling_level="sequence"), eval_mode=True),
    # TRL 1.14 scores an MoE model from its full logits (no hidden states for the fused loss): the log-prob path
    "moe_router_aux_loss": Case(
        config=dict(loss_type="grpo", beta=0.04),
        arch="mixtral",
        fallback="router aux loss" if TRL_RELEASE == (1, 14) else None,
    ),
    # TRL's entropy bonus: in the fused kernels' pass (the mean entropy of the loss' own distribution, whatever the
    # loss type), and on the log-prob path with top_entropy_quantile (the bonus then acts on the high-entropy tokens)
    "entropy_coef_grpo": Case(config=dict(loss_type="grpo", beta=0.04, entropy_coef=0.05)),
    "entropy_coef_dapo_sequence": Case(
        config=dict(loss_type="dapo", importance_sampling_level="sequence", entropy_coef=0.2)
    ),
    "entropy_coef_cispo_temperature": Case(config=dict(loss_type="cispo", entropy_coef=-0.1, temperature=0.7)),
    "entropy_coef_vespo": Case(config=dict(loss_type="vespo", entropy_coef=0.1)),
    "entropy_coef_softcap": Case(
        config=dict(loss_type="bnpo", entropy_coef=0.1), model_config=dict(final_logit_softcapping=0.5)
    ),
    "entropy_coef_eval": Case(config=dict(loss_type="dapo", entropy_coef=0.1), eval_mode=True),
    "entropy_coef_top_entropy_quantile": Case(
        config=dict(loss_type="grpo", entropy_coef=0.1, top_entropy_quantile=0.5)
    ),
    "adaptive_entropy_top_entropy_quantile": Case(
        config=dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
                    top_entropy_quantile=0.2, importance_sampling_level="sequence"),
        attrs=dict(_last_world_entropy=0.5),
    ),
    # adaptive control (Skywork-OR1): the bonus applies when the last step's entropy was at most the target
    "adaptive_entropy_applied": Case(config=dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05,
                                                 entropy_target=100.0), attrs=dict(_last_world_entropy=0.5)),
    "adaptive_entropy_gated": Case(config=dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05,
                                               entropy_target=0.1), attrs=dict(_last_world_entropy=0.5)),
    # TRL's default mixed precision: the LM head runs in bfloat16 in both, so only bf16 rounding differs
    "bf16_autocast": Case(config=dict(loss_type="dapo", beta=0.04, bf16=True), tol=2e-2),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_patched_trl_options_match(case, llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    model_dir = llama_dir
    if case.arch != "llama" or case.model_config:
        model_dir = save_model(tmp_path / case.arch, tokenizer, case.arch, **case.model_config)
    trainer = make_trainer(model_dir, tokenizer, tmp_path, **case.config)
    for name, value in case.attrs.items():  # vLLM cannot run here: its batch fields and switches are set by hand
        setattr(trainer, name, value)
    if case.eval_mode:
        trainer.model.eval()
    inputs = make_inputs(trainer, **case.inputs)
    metrics = compare(trainer, inputs, grpo_ext_calls, tol=case.tol, fallback=case.fallback)
    if case.arch == "mixtral":
        assert trainer.aux_loss_enabled and metrics["aux_loss"] > 0


def test_fused_path_projects_only_completion_rows_one_chunk_at_a_time(tokenizer, tmp_path, monkeypatch, grpo_ext_calls):
    """The fused loss: no log-prob pass, the LM head sees the B x T completion rows only, in chunks of 4 rows."""
    # V = 97 (the ids are drawn from the model's V): no other dimension of the model equals it
    model_dir = save_model(tmp_path / "v97", tokenizer, vocab_size=97)
    trainer = make_trainer(model_dir, tokenizer, tmp_path, loss_type="grpo", beta=0.04)
    inputs = make_inputs(trainer, old=False)
    expected = loss_and_grads(trainer, inputs)
    grpo_trl.patch(trainer)
    vocab, chunk = trainer.model.config.vocab_size, 4
    monkeypatch.setattr(grpo_ext.ops.lm_head, "LOGITS_CHUNK_BYTES", chunk * vocab * 4)  # 4 float32 rows of logits
    # the loss' chunks under CUDA's rule (on a CPU they may grow to the [V, H] weight gradient's size)
    monkeypatch.setattr(grpo_ext.ops.lm_head, "hidden_chunk_budget",
                        lambda *_: grpo_ext.ops.lm_head.LOGITS_CHUNK_BYTES)  # fmt: skip
    vocab_rows: list[int] = []  # rows of every tensor allocated (not a view, not in place) whose last dimension is V
    projected_rows: list[int] = []  # rows of the LM-head products (matmuls whose output has V columns)

    class RecordShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(ret.alias_info is not None for ret in func._schema.returns):
                return out  # a view or an in-place result: no new memory
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab:
                    vocab_rows.append(t.numel() // vocab)
                    if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                        projected_rows.append(t.numel() // vocab)
            return out

    with RecordShapes():
        actual = loss_and_grads(trainer, inputs)
    assert_same(expected, actual)
    assert grpo_ext_calls.grpo_loss_from_hidden == 1
    assert grpo_ext_calls.grpo_loss == grpo_ext_calls.selective_log_softmax == 0
    assert max(vocab_rows) <= chunk  # never more than one chunk of logits, let alone [B, T, V]
    # the kept completion positions, each once (TRL's head scores B x (P + T - 1); padding costs no GEMM: issue 31)
    assert sum(projected_rows) == int((inputs["completion_mask"] != 0).sum()) < B * T


def test_torch_compiled_tied_model_matches_trl(tokenizer, tmp_path, grpo_ext_calls):
    """``torch_compile=True`` (the model compiled by accelerate's prepare, as transformers' Trainer does) with a tied
    embedding: the patched, compiled model gives TRL's eager loss and gradients over two steps, and the tied lookup
    runs outside dynamo's graph, so that its backward adds its rows into the fused head's gradient (traced, it would
    bake in the dense fallback: the sink is empty at trace time). aot_eager, so that the backward's aten ops are
    visible here; what dynamo traces is the same under TRL's default inductor."""
    model_dir = save_model(tmp_path / "qwen2_tied", tokenizer, "qwen2_tied")
    trainer = make_trainer(model_dir, tokenizer, tmp_path, loss_type="dapo", beta=0.04, torch_compile=True,
                           torch_compile_backend="aot_eager")  # fmt: skip
    inputs = make_inputs(trainer)
    expected = loss_and_grads(trainer, inputs)
    weight = trainer.model.get_input_embeddings().weight
    weight_sized: list[str] = []  # the backward's aten ops with an output the weight's shape

    class RecordWeightSized(TorchDispatchMode):  # sees the compiled backward's aten ops too, without tracing anything
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            weight_sized.extend(str(func) for t in torch.utils._pytree.tree_leaves(out)
                                if isinstance(t, torch.Tensor) and t.shape == weight.shape)  # fmt: skip
            return out

    grpo_trl.patch(trainer)
    compiled = trainer.accelerator.prepare(trainer.model)
    assert compiled is not trainer.model and hasattr(compiled, "_orig_mod")  # really compiled
    for step in (1, 2):
        trainer.model.zero_grad(set_to_none=True)
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(compiled, inputs)
        weight_sized.clear()
        with RecordWeightSized():
            loss.backward()
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        assert_same(expected, (loss.detach(), grads, metrics))
        # the embedding's rows added in place into the fused head's gradient (made in the forward): no dense
        # embedding gradient (zeros, index_add) and no sum of two (add), as when dynamo traced the lookup
        assert grpo_ext_calls.grpo_loss_from_hidden == step and "aten.index_add_.default" in weight_sized
        assert not {"aten.zeros.default", "aten.index_add.default", "aten.add.Tensor"} & set(weight_sized)


def test_fused_path_on_trl_compact_rows(llama_dir, tokenizer, tmp_path, monkeypatch, grpo_ext_calls):
    """On Triton devices TRL hands the head only the labelled rows: scattered back, the loss is still TRL's."""
    trainer = make_trainer(llama_dir, tokenizer, tmp_path, loss_type="dapo", beta=0.04)
    inputs = make_inputs(trainer, tool_mask=True)
    expected = loss_and_grads(trainer, inputs)
    if hasattr(trl.trainer.utils, "_use_triton"):  # TRL 1.16; 1.14 and 1.15 always pass the compact rows
        monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    grpo_trl.patch(trainer)
    actual = loss_and_grads(trainer, inputs)
    assert grpo_ext_calls.grpo_loss_from_hidden == 1 and grpo_ext_calls.grpo_loss == 0
    assert_same(expected, actual)


# ---------------------------------------------------------------------------------------------------------------
# the log-prob pass
# ---------------------------------------------------------------------------------------------------------------


LOG_PROB_CASES = {
    "llama": ("llama", {}, {}, None),
    "softcap_scale_temperature": (
        "llama",
        dict(final_logit_softcapping=3.0, logit_scale=0.7),
        dict(temperature=0.7),
        None,
    ),
    "phi_lm_head_bias": ("phi", {}, {}, None),
    "qwen2_tied_embeddings": ("qwen2_tied", {}, {}, None),
    "row_chunks": ("llama", {}, {}, 3),  # 3 rows per projection chunk: several chunks and a ragged last one
}


@pytest.mark.parametrize(("arch", "config_extra", "overrides", "chunk_rows"), list(LOG_PROB_CASES.values()),
                         ids=list(LOG_PROB_CASES))  # fmt: skip
def test_log_prob_pass_matches_trl(arch, config_extra, overrides, chunk_rows, tokenizer, tmp_path, monkeypatch,
                                   grpo_ext_calls):  # fmt: skip
    """Log-probs, entropy and the gradients through both (LM head weight and bias, backbone) equal TRL's."""
    if chunk_rows is not None:
        monkeypatch.setattr(grpo_trl.log_probs, "chunk_rows", lambda rows, vocab, element_size: chunk_rows)
    model_dir = save_model(tmp_path / arch, tokenizer, arch, **config_extra)
    trainer = make_trainer(model_dir, tokenizer, tmp_path, **overrides)
    inputs = make_inputs(trainer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    g = torch.Generator().manual_seed(5)
    w_logps, w_entropy = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        trainer.model.zero_grad(set_to_none=True)
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, T, compute_entropy=True
        )
        ((logps * w_logps).sum() + (entropy * w_entropy).sum()).backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return logps.detach(), entropy.detach(), grads

    logps0, entropy0, grads0 = run()
    grpo_trl.patch(trainer)
    logps1, entropy1, grads1 = run()
    # forward chunks plus their recomputation in the backward, over the rows TRL's head scores
    scored = B * (P + T - 1) if HEAD_SCORES_EVERY_POSITION else int((inputs["completion_mask"] != 0).sum())
    assert grpo_ext_calls.selective_log_softmax >= (2 * (scored // chunk_rows) if chunk_rows else 2)
    torch.testing.assert_close(logps1, logps0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy1, entropy0, rtol=1e-5, atol=1e-5)
    assert grads1.keys() == grads0.keys()
    assert all(g.abs().max() > 0 for g in grads0.values() if g.dim() > 1 or arch == "phi")
    if arch == "phi":
        assert "lm_head.bias" in grads0
    for name, g0 in grads0.items():
        torch.testing.assert_close(grads1[name], g0, rtol=1e-5, atol=1e-5 * max(g0.abs().max().item(), 1e-6))
    # the swap is scoped to the call: TRL's own function is back in place for everything else
    assert trl.trainer.utils._ChunkedLogProbFunction is not grpo_trl.GrpoExtHead


# ---------------------------------------------------------------------------------------------------------------
# TRL's training loop, patch / unpatch, errors, import isolation
# ---------------------------------------------------------------------------------------------------------------


def test_subclass_trains_like_trl(llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    """Two optimizer steps of TRL's own loop (generation, old and reference log-probs, loss, logging) agree."""
    options = dict(max_steps=2, loss_type="dapo", beta=0.04, learning_rate=1e-2, gradient_accumulation_steps=1,
                   steps_per_generation=1, max_completion_length=4)  # fmt: skip
    reference = make_trainer(llama_dir, tokenizer, tmp_path / "a", **options)
    reference.train()
    assert grpo_ext_calls.grpo_loss == 0
    ours = make_trainer(llama_dir, tokenizer, tmp_path / "b", cls=grpo_trl.GRPOExtTrainer, **options)
    assert grpo_trl.is_patched(ours) and not grpo_trl.is_patched(reference)
    ours.train()
    assert ours.logps_backend == "fused"
    # 2 x (the reference log-prob pass, then the fused loss)
    assert grpo_ext_calls.grpo_loss_from_hidden == 2 and grpo_ext_calls.selective_log_softmax >= 2
    assert grpo_ext_calls.grpo_loss == 0
    assert_same_training(reference, ours, ("loss", "kl", "entropy", "grad_norm", "reward", "clip_ratio/region_mean"))


@pytest.mark.parametrize("backend", grpo_trl.LOGPS_BACKENDS)
def test_adaptive_entropy_over_accumulation_windows_matches_trl(backend, llama_dir, tokenizer, tmp_path):
    """Four micro-batches, two accumulation windows: the window's entropy is accumulated over its micro-batches, the
    coefficient moves at each optimizer step (up, then gated off and down), as in TRL, and so do the losses."""
    config = dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.02)
    trainers = [make_trainer(llama_dir, tokenizer, tmp_path / name, **config) for name in ("trl", "ours")]
    grpo_trl.patch(trainers[1], logps_backend=backend)
    for trainer in trainers:
        trainer._last_world_entropy = 0.0  # a measurement below the target: the bonus applies from the start
    targets = (100.0, 100.0, 0.1, 0.1)  # the second window's entropy is above its target: gated off, coef down
    results: list[list] = [[], []]
    for step, target in enumerate(targets):
        batch = make_inputs(trainers[0], seed=step)
        for trainer, out in zip(trainers, results, strict=True):
            trainer.args.entropy_target = target
            trainer.accelerator.gradient_state._set_sync_gradients(step % 2 == 1)
            loss, grads, metrics = loss_and_grads(trainer, batch)
            out.append(((loss, grads, metrics), entropy_control_state(trainer)))
    for (expected, state0), (actual, state1) in zip(*results, strict=True):
        assert_same(expected, actual)
        assert_same_entropy_control(state0, state1, 1e-5)
    coefs = [state["entropy_coef"] for _, state in results[0]]
    assert coefs == pytest.approx([0.05, 0.07, 0.07, 0.05])  # the controller did move, both ways


def test_subclass_with_entropy_bonus_trains_like_trl(llama_dir, tokenizer, tmp_path, grpo_ext_calls):
    """Two optimizer steps of TRL's loop with the adaptive entropy bonus and 2 accumulation steps: the logged loss,
    policy_loss, entropy_coef and the parameters agree; the checkpoint holds TRL's controller state."""
    options = dict(max_steps=2, loss_type="dapo", learning_rate=1e-2, gradient_accumulation_steps=2,
                   steps_per_generation=2, per_device_train_batch_size=2,  # one prompt's 4 completions a step
                   max_completion_length=4, use_adaptive_entropy=True, entropy_coef=0.05,
                   entropy_target=100.0, save_strategy="steps", save_steps=2)  # fmt: skip
    reference = make_trainer(llama_dir, tokenizer, tmp_path / "a", **options)
    reference.train()
    ours = make_trainer(llama_dir, tokenizer, tmp_path / "b", cls=grpo_trl.GRPOExtTrainer, **options)
    ours.train()
    assert grpo_ext_calls.grpo_loss_from_hidden == 4 and grpo_ext_calls.grpo_loss == 0
    # Adam's g / sqrt(v) magnifies the float rounding of tiny gradients: parameters to 1e-5
    logs = assert_same_training(reference, ours, ("loss", "policy_loss", "entropy_coef", "entropy", "grad_norm",
                                                  "reward"), param_atol=1e-5)  # fmt: skip
    assert logs[1]["entropy_coef"] > logs[0]["entropy_coef"]  # the bonus applied from the second step on
    saved = [json.loads((path / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
             for path in (tmp_path / "a" / "trl", tmp_path / "b" / "trl")]  # fmt: skip
    assert saved[1] == pytest.approx(saved[0], rel=1e-5)
