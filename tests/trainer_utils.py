"""Helpers of the trainer tests (tests/test_trainer.py, tests/test_faults.py, tests/test_cli.py): the demo's tiny
model in a small config, a local model folder and dataset for the CLI, metrics files."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import grpo_ext
from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.metrics import TIMING_METRICS
from grpo_ext.trainer.policy_logps import fused_policy_loss, plain_token_logps
from grpo_ext.trainer.trainer import GRPOTrainer


@contextlib.contextmanager
def gloo_rank(rank: int, store: str, world: int):
    """One process of a gloo group over a file store (the CPU multi-process tests), torch on one thread."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        yield
    finally:
        # DDP/FSDP2 objects left from the body hold the group: collected first, so that destroying it joins gloo's
        # threads now rather than at the interpreter's exit (where a late teardown aborted a child, SIGABRT)
        gc.collect()
        dist.destroy_process_group()


def small_config(tmp_path, **overrides) -> GRPOConfig:
    options = dict(
        output_dir=str(tmp_path / "run"), seed=3, max_steps=4, num_generations=4, per_device_train_batch_size=16,
        max_completion_length=4, max_prompt_length=None, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=1, report_to="none", disable_tqdm=True, log_completions=False, plot=False,
    )  # fmt: skip
    options.update(overrides)
    return GRPOConfig(**options)


def make_trainer(config: GRPOConfig, model_seed: int = 0, reward_funcs=None) -> GRPOTrainer:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=model_seed)
    train_rows, _ = reversal_dataset(seed=0)
    return GRPOTrainer(model, reward_funcs or [reversal_reward], train_rows, config, tokenizer=tokenizer)


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_METRICS}


def write_cli_inputs(folder: Path, num_rows: int = 40, **options) -> Path:
    """A local model folder, a JSONL dataset and a run file for ``grpo-ext train`` in ``folder``; returns the run
    file. ``options`` are written into it (after the defaults)."""
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    train_rows, _ = reversal_dataset(seed=0)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows[:num_rows]))
    run = {
        "model_name_or_path": str(folder / "model"), "dataset": str(folder / "data.jsonl"),
        "reward_funcs": ["graded_answer"], "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 4, "max_steps": 5, "report_to": "none", "disable_tqdm": True, "plot": False,
        "adam_epsilon": 1e-6, "learning_rate": 1e-3, "output_dir": str(folder / "out"), **options,
    }  # fmt: skip
    (folder / "run.yaml").write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in run.items()))
    return folder / "run.yaml"


class AttentionCalls:
    """Counts the calls of each decoder layer's attention of ``model`` (every ``transformers`` decoder layer that can
    be checkpointed), to see that gradient checkpointing recomputes: 2 per layer and micro-batch when it is on.

    A forward pre-hook on ``self_attn``: a hook on the layer itself sits outside what transformers checkpoints (it fires
    once), and torch's recompute stops as soon as the last saved tensor is back, before the layer's end.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert layers, "no decoder layer found"
        self.counts = [0] * len(layers)
        self.positions: list[int] = []  # positions the first layer's attention saw, call by call
        self._handles = [
            layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]

    def _hook(self, index: int):
        def count(module, args, kwargs) -> None:
            self.counts[index] += 1
            if index == 0:
                self.positions.append(kwargs["hidden_states"].shape[1])

        return count

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)
        self.positions.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def step_loss_and_grads(trainer: GRPOTrainer, fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss and the parameters' gradients, through the fused or the plain path (policy = model)."""
    mb = dict(trainer._micro_batches[0])
    options = dict(old_logps=mb["old_logps"], ref_logps=mb["ref_logps"], beta=0.04, loss_type="dapo",
                   sample_mask=~mb["zero_std"])  # fmt: skip
    trainer.model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks (GPT-2) on both paths
    if fused:
        loss = fused_policy_loss(trainer.model, trainer.model, mb, trainer.config.temperature, **options).loss
    else:
        logps = plain_token_logps(trainer.model, mb, trainer.config.temperature, "plain")
        loss = grpo_ext.grpo_loss(logps, mb["advantages"], mb["completion_mask"], **options).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


class Killed(BaseException):
    """What a ``kill -9`` leaves is a save stopped at one point: nothing after it runs (no ``except``, no cleanup)."""


def kill_after_rename_to(monkeypatch, name: str) -> None:
    """Make ``os.replace`` raise :class:`Killed` right after a rename into a path named ``name`` (a save killed
    between its two renames); ``monkeypatch.undo()`` restores it."""
    replace = os.replace

    def killed_after_rename(source, target):
        replace(source, target)
        if Path(target).name == name:
            raise Killed

    monkeypatch.setattr(os, "replace", killed_after_rename)
