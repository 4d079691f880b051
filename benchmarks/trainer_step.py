"""One contender's training step in this process: ``bench_trainer.py``'s child (``run_child``), run in a fresh
process per contender and case so that its peak memory is its own. The model, the fixed batch and the reward, the
runners of grpo_ext's trainer and of TRL's (with or without grpo_ext), the timed and profiled steps, the GEMM floor,
and ``--memory-sites``' recorded step; ``bench_trainer.py``'s docstring says what each figure means.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness`, wherever run from

import torch

import memory_sites
from harness import timing
from step_profile import StepMarkers, step_parts

NUM_GENERATIONS = 4
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")




def build_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` tokens ``<pad> <bos> <eos> <unk> w4 ... w{V-1}`` (space separated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def build_model(case: dict[str, Any], tokenizer, device: torch.device):
    """The random-init Qwen2 causal LM of the case (seeded, float32)."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=case["vocab"], hidden_size=case["hidden"],
        intermediate_size=case.get("intermediate") or 2 * case["hidden"], num_hidden_layers=case["layers"],
        num_attention_heads=case.get("heads", 4), num_key_value_heads=case.get("kv_heads", 2),
        max_position_embeddings=case["prompt_length"] + case["length"] + 8,
        tie_word_embeddings=case.get("tied", False), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(case["seed"])
    return transformers.Qwen2ForCausalLM(config).to(device)


def prompts_of(case: dict[str, Any]) -> list[str]:
    """``batch / G`` distinct prompts of ``prompt_length`` words."""
    count = case["batch"] // NUM_GENERATIONS
    return [" ".join(f"w{4 + (7 * p + i) % 50}" for i in range(case["prompt_length"])) for p in range(count)]


def fixed_batch(case: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The step's batch: full prompts and full completions of ``T`` random tokens, advantages of both signs."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    rows, vocab = case["batch"], case["vocab"]
    prompt_ids = torch.randint(len(SPECIAL_TOKENS), vocab, (rows, case["prompt_length"]), generator=g)
    completion_ids = torch.randint(len(SPECIAL_TOKENS), vocab, (rows, case["length"]), generator=g)
    advantages = torch.randn(rows, generator=g)
    batch = dict(
        prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids, dtype=torch.bool), advantages=advantages,
    )  # fmt: skip
    return {name: value.to(device) for name, value in batch.items()}


@torch.no_grad()
def reference_logps(model, batch: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    """``[B, T]`` float32: the completion tokens' log-probs under ``model`` (float32, one row at a time, so that no
    ``[B, P + T, V]`` logits exist), plus seeded noise of std 0.05: the fixed batch's reference log-probs."""
    prompt_length = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    rows = []
    for row in ids:
        logits = model(input_ids=row[None], use_cache=False).logits[0, prompt_length - 1 : -1].float()
        rows.append(logits.log_softmax(-1).gather(-1, row[prompt_length:, None])[:, 0])
    noise = torch.randn(ids.shape[0], ids.shape[1] - prompt_length, generator=torch.Generator().manual_seed(seed))
    return torch.stack(rows) + 0.05 * noise.to(ids.device)


def reward(prompts, completions, **columns) -> list[float]:
    return [float(len(c) % 7) for c in completions]


def autocast_grpo_ext_on_cpu() -> None:
    """grpo_ext's ``GRPOConfig(bf16=True)`` autocasts to bfloat16 on CUDA only (``sampling.bf16_autocast``); this
    gives its trainer the same autocast on the CPU, at the same places (the names its trainer and rollout call)."""
    import grpo_ext.trainer.rollout as rollout_module
    import grpo_ext.trainer.trainer as trainer_module

    def bf16_autocast(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()

    trainer_module.bf16_autocast = rollout_module.bf16_autocast = bf16_autocast


def grpo_ext_runner(case: dict[str, Any], backend: str, model, tokenizer, device: torch.device, out_dir: str,
                    ref_logps: torch.Tensor | None):  # fmt: skip
    """(step on the fixed batch, generation + step, the trained model) of grpo_ext's own trainer."""
    import dataclasses

    from grpo_ext.trainer import GRPOConfig, GRPOTrainer

    bf16 = case["precision"] == "bf16"
    if bf16 and device.type != "cuda":
        autocast_grpo_ext_on_cpu()
    options = dict(case["options"])
    if "gradient_checkpointing" in {field.name for field in dataclasses.fields(GRPOConfig)}:
        options["gradient_checkpointing"] = case["checkpointing"]  # (select_contenders: n/a when on and absent)
    config = GRPOConfig(
        output_dir=out_dir, logps_backend=backend, per_device_train_batch_size=case["batch"],
        num_generations=NUM_GENERATIONS, max_completion_length=case["length"], max_prompt_length=None,
        gradient_accumulation_steps=1, beta=case["beta"], loss_type="dapo", learning_rate=1e-5, report_to="none",
        bf16=bf16, save_steps=0, plot=False, log_completions=False, **options,
    )  # fmt: skip
    dataset = [{"prompt": p} for p in prompts_of(case)]
    trainer = GRPOTrainer(model, reward, dataset, config=config, tokenizer=tokenizer)
    batch = fixed_batch(case, device)
    micro = dict(batch, zero_std=torch.zeros(case["batch"], dtype=torch.bool, device=device), old_logps=None,
                 ref_logps=ref_logps)  # fmt: skip

    def step() -> float:
        trainer._micro_batches = [micro]
        return float(trainer._training_step()["grad_norm"])

    def generate_and_step() -> float:
        trainer._micro_batches = []
        return float(trainer._training_step()["grad_norm"])  # generates when the queue is empty

    return step, generate_and_step, trainer.model


def trl_runner(case: dict[str, Any], backend: str | None, model_dir: str, tokenizer, device: torch.device,
               out_dir: str, ref_logps: torch.Tensor | None):  # fmt: skip
    """(step on the fixed batch, generation + step, the trained model) of TRL's GRPOTrainer, or of GRPOExtTrainer
    with ``backend``, given the model as a directory (loaded by TRL) and run as ``Trainer.train()`` runs a step."""
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=out_dir, report_to="none", use_cpu=device.type == "cpu", bf16=case["precision"] == "bf16",
        seed=case["seed"], per_device_train_batch_size=case["batch"], num_generations=NUM_GENERATIONS,
        max_completion_length=case["length"], gradient_accumulation_steps=1, steps_per_generation=1,
        beta=case["beta"], loss_type="dapo", learning_rate=1e-5, save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=case["checkpointing"], **case["options"],
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": prompts_of(case)})
    kwargs = dict(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    if backend is None:
        trainer = trl.GRPOTrainer(**kwargs)
    else:
        from grpo_ext.integrations.trl import GRPOExtTrainer

        trainer = GRPOExtTrainer(logps_backend=backend, **kwargs)
    # What transformers' Trainer.train() does before its first step: checkpointing, the optimizer, then
    # accelerator.prepare (which wraps the forward in bf16 autocast when args.bf16).
    if case["checkpointing"]:
        enable_checkpointing(trainer.model)
    trainer.create_optimizer()
    model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.model_wrapped = model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' loop, read by TRL's loss
    batch = fixed_batch(case, device)
    fixed = dict(batch, completion_mask=batch["completion_mask"].long(),
                 num_items_in_batch=batch["completion_mask"].sum())  # fmt: skip
    if ref_logps is not None:
        fixed["ref_per_token_logps"] = ref_logps
    rows = [{"prompt": p} for p in prompts_of(case) for _ in range(NUM_GENERATIONS)]

    def train_on(inputs) -> float:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def generate_and_step() -> float:
        model.eval()
        inputs = trainer._generate_and_score_completions(rows)
        model.train()
        return train_on(inputs)

    return (lambda: train_on(fixed)), generate_and_step, trainer.accelerator.unwrap_model(model)


def enable_checkpointing(model) -> None:
    """transformers' activation checkpointing of ``model``'s layers with ``use_reentrant=False``, as
    ``transformers.Trainer.train()`` enables it (``gradient_checkpointing_enable`` before transformers 5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------------
# where the time goes (--profile) and the GEMM floor
# ---------------------------------------------------------------------------------------------------------------

def gemm_floor_ms(rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """Median ms of the three products of an LM head over ``rows`` tokens: logits ``[N, H] x [H, V]``, the input's
    gradient ``[N, V] x [V, H]`` and the weight's ``[V, N] x [N, H]`` (one warm-up first; outputs preallocated)."""
    products = timing.lm_head_gemms(rows, hidden, vocab, dtype, device)

    def timed() -> float:
        _sync(device)
        start = time.perf_counter()
        products()
        _sync(device)
        return 1e3 * (time.perf_counter() - start)

    timed()
    return statistics.median(timed() for _ in range(reps))


class GenerateTimer:
    """Times every ``model.generate`` call (the instance's method wrapped): the generation inside ``gen+step``."""

    def __init__(self, model, device: torch.device) -> None:
        self.seconds = 0.0
        original = model.generate

        def generate(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync(device)
                self.seconds += time.perf_counter() - start

        model.generate = generate


def run_child(case: dict[str, Any]) -> dict[str, Any]:
    """Builds the contender, runs one warm-up step, then times ``steps`` steps (profiled with ``profile``) and one
    generation + step, and with ``profile`` the GEMM floor.

    Returns:
        ``step_ms`` (median), ``gen_step_ms`` and ``gen_ms`` (None without ``generation``), ``peak_bytes`` above
        ``base_bytes`` (RSS or allocated before the timed steps), ``grad_norm``: the gradient norm of the warm-up step
        (same parameters and batch everywhere), and with ``profile`` ``profile`` (:func:`step_parts`) and
        ``gemm_floor_ms``.
    """
    device = torch.device(case["device"])
    torch.manual_seed(case["seed"])
    if case.get("hidden_chunk_rows"):  # the op's default for every caller in this process (trainer, TRL integration)
        import grpo_ext.ops.grpo_loss_from_hidden  # noqa: F401 (the module; the package's name is the function)

        hidden_op = sys.modules["grpo_ext.ops.grpo_loss_from_hidden"]
        hidden_op.head_chunking = lambda *_: (case["hidden_chunk_rows"], 0)  # and no one chunk of the kept rows
    tokenizer = build_tokenizer(case["vocab"])
    model = build_model(case, tokenizer, device)
    ref_logps = reference_logps(model, fixed_batch(case, device), case["seed"] + 2) if case["beta"] else None
    family, _, backend = case["contender"].partition("/")
    with tempfile.TemporaryDirectory() as out_dir:
        if family == "grpo_ext":
            step, generate_and_step, trained = grpo_ext_runner(case, backend, model, tokenizer, device, out_dir,
                                                               ref_logps)  # fmt: skip
        else:  # TRL loads the policy (and the reference) from a directory, as from a model id
            model_dir = os.path.join(out_dir, "model")
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            del model
            step, generate_and_step, trained = trl_runner(case, backend or None, model_dir, tokenizer, device, out_dir,
                                                          ref_logps)  # fmt: skip
        grad_norm = step()  # warm-up: the optimizer state and the allocator's pools exist from here on
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            before = _rss_bytes("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        markers = StepMarkers(trained) if case["profile"] else None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities) if markers else contextlib.nullcontext()
        times = []
        with profiler:
            for _ in range(case["steps"]):
                with markers.step() if markers else contextlib.nullcontext():
                    start = time.perf_counter()
                    step()
                    _sync(device)
                    times.append(1e3 * (time.perf_counter() - start))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmHWM")
        result = dict(step_ms=statistics.median(times), gen_step_ms=None, gen_ms=None,
                      peak_bytes=max(0, peak - before), base_bytes=before, grad_norm=grad_norm)  # fmt: skip
        if markers:
            markers.remove()
            result["profile"] = step_parts(profiler.events(), markers, device)
        if case.get("memory_sites") and device.type == "cuda":  # one more step, its allocations recorded with stacks
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
            try:
                step()
                _sync(device)
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            result["memory_sites"] = memory_sites.peak_sites(snapshot, device.index or 0)
        elif case.get("memory_sites"):  # the CPU: the profiler's allocation events, under the calls that made them
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                        with_stack=True) as memory_profile:  # fmt: skip
                step()
            trace = memory_sites.profiler_trace(memory_profile, device.type)
            result["memory_sites"] = memory_sites.peak_sites({"device_traces": [trace]})
        if case["generation"]:
            timer = GenerateTimer(trained, device)
            start = time.perf_counter()
            generate_and_step()
            _sync(device)
            result.update(gen_step_ms=1e3 * (time.perf_counter() - start), gen_ms=1e3 * timer.seconds)
    if case["profile"]:
        dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
        tokens = case["batch"] * case["length"]
        result["gemm_floor_ms"] = gemm_floor_ms(tokens, case["hidden"], case["vocab"], dtype, device, case["steps"])
    return result
