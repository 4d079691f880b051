"""GRPOTrainer: rollouts with ``model.generate``, rewards, grpo_ext advantages and loss, AdamW, checkpoints."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

import grpo_ext

from .config import TOKEN_LEVEL_LOSS_TYPES, GRPOConfig

RewardFunc = Callable[..., list]
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Metrics that depend on the wall clock: they differ between two otherwise identical runs.
TIMING_METRICS = ("step_time", "tokens_per_second")


def _reward_name(func: RewardFunc) -> str:
    return getattr(func, "__name__", type(func).__name__)


class GRPOTrainer:
    """GRPO on a causal LM from ``transformers`` (or any module with the same ``generate``/``forward``).

    Args:
        model: the policy, a ``PreTrainedModel`` (``forward(input_ids, attention_mask, position_ids).logits`` and
            ``generate``); trained in place.
        reward_funcs: one callable or a list, each ``f(prompts, completions, **columns) -> list[float | None]``.
        train_dataset: a sequence of dicts with a ``prompt`` string and any other columns (given to the rewards).
        config: the options (default ``GRPOConfig()``).
        ref_model: the frozen reference for the KL term; default a deep copy of ``model`` made here, only when
            ``config.beta != 0``.
        tokenizer: a ``transformers`` tokenizer with ``pad_token_id`` and ``eos_token_id`` (left padding is used).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        train_dataset: Sequence[dict[str, Any]],
        config: GRPOConfig | None = None,
        ref_model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.config = config if config is not None else GRPOConfig()
        cfg = self.config
        if tokenizer is None:
            raise ValueError("GRPOTrainer needs a tokenizer (to encode prompts and decode completions)")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to the EOS token)")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token: completions could never stop")
        self.model = model
        self.tokenizer = tokenizer
        self.reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function")
        self.reward_names = [_reward_name(f) for f in self.reward_funcs]
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"GRPOConfig.reward_weights has {len(cfg.reward_weights)} entries but there are "
                f"{len(self.reward_funcs)} reward functions"
            )
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty")
        self.train_dataset = train_dataset
        self.device = next(model.parameters()).device
        self.use_bf16 = cfg.bf16 if cfg.bf16 is not None else self.device.type == "cuda"

        self.beta = cfg.beta  # moved by the adaptive KL controller when cfg.kl_target is set
        self.ref_model = None
        if cfg.beta != 0:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
        # The sampling policy's log-probs are needed only when the policy can move between generation and use.
        self.needs_old_logps = cfg.num_iterations > 1 or cfg.steps_per_generation > 1

        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
        )  # fmt: skip
        from transformers import get_scheduler

        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * cfg.max_steps)
        self.lr_scheduler = get_scheduler(
            cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=cfg.max_steps
        )

        self.global_step = 0
        self._micro_batches: list[dict[str, Any]] = []  # scored rollouts waiting to be trained on
        self._rollout_metrics: dict[str, float] = {}
        self._sample_completions: list[tuple[str, str, float]] = []
        self._prompt_order: list[int] = []  # this epoch's shuffled dataset indices
        self._prompt_pos = 0
        self.output_dir = Path(cfg.output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.plot_path = self.output_dir / "metrics.png"
        self._tb_writer = None
        self._seed_everything(cfg.seed)

    # ------------------------------------------------------------------------------------------------------------
    # Rollouts
    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
        try:
            import numpy as np

            np.random.seed(seed)  # noqa: NPY002  (the global RNG user reward functions may use)
        except ImportError:
            pass

    def _next_prompt_rows(self, num_prompts: int) -> list[dict[str, Any]]:
        """Dataset rows without replacement within an epoch, reshuffled (from the torch RNG) each epoch."""
        rows = []
        while len(rows) < num_prompts:
            if self._prompt_pos >= len(self._prompt_order):
                self._prompt_order = torch.randperm(len(self.train_dataset)).tolist()
                self._prompt_pos = 0
            rows.append(self.train_dataset[self._prompt_order[self._prompt_pos]])
            self._prompt_pos += 1
        return rows

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        self.tokenizer.padding_side = "left"  # generation appends on the right
        kwargs: dict[str, Any] = {"return_tensors": "pt", "padding": True, "add_special_tokens": False}
        if self.config.max_prompt_length is not None:
            # Keep the end of long prompts: the question usually sits there.
            self.tokenizer.truncation_side = "left"
            kwargs.update(truncation=True, max_length=self.config.max_prompt_length)
        enc = self.tokenizer(prompts, **kwargs)
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def _autocast(self):
        if self.use_bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def generate(
        self, prompts: list[str], num_return_sequences: int, greedy: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Sample completions and their masks.

        Args:
            prompts: ``[P]`` prompt strings.
            num_return_sequences: completions per prompt (contiguous rows in the output).
            greedy: argmax decoding instead of sampling (evaluation).

        Returns:
            ``prompt_ids [N, Lp]`` int64 (left-padded), ``prompt_mask [N, Lp]`` int64, ``completion_ids [N, T]``
            int64, ``completion_mask [N, T]`` bool (tokens up to and including the first EOS) and ``truncated [N]``
            bool (no EOS within ``max_completion_length``), with ``N = P * num_return_sequences``.
        """
        cfg = self.config
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        prompt_ids = prompt_ids.repeat_interleave(num_return_sequences, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_return_sequences, dim=0)
        sampling = {} if greedy else {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        was_training = self.model.training
        self.model.eval()
        with self._autocast():
            sequences = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=not greedy,
                max_new_tokens=cfg.max_completion_length, pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id, **sampling,
            )  # fmt: skip
        self.model.train(was_training)
        completion_ids = sequences[:, prompt_ids.shape[1] :]
        is_eos = completion_ids == self.tokenizer.eos_token_id
        has_eos = is_eos.any(dim=1)
        length = completion_ids.shape[1]
        first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, length, dtype=torch.long))
        positions = torch.arange(length, device=completion_ids.device)
        completion_mask = positions.unsqueeze(0) <= first_eos.unsqueeze(1)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, ~has_eos

    def decode_completions(self, completion_ids: Tensor, completion_mask: Tensor) -> list[str]:
        """Completion texts: tokens up to the first EOS, special tokens removed."""
        rows = [ids[mask].tolist() for ids, mask in zip(completion_ids, completion_mask, strict=True)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    def token_logps(self, model: torch.nn.Module, batch: dict[str, Any], with_entropy: bool = False):
        """Per-token log-probs of the completion tokens under ``model``.

        Args:
            model: a causal LM.
            batch: ``prompt_ids``/``prompt_mask`` ``[N, Lp]`` and ``completion_ids``/``completion_mask`` ``[N, T]``.
            with_entropy: also return the per-token entropy (detached).

        Returns:
            ``logps [N, T]`` float32 (differentiable when grad is on); with ``with_entropy`` also ``entropy [N, T]``.
        """
        prompt_len = batch["prompt_ids"].shape[1]
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"].long()], dim=1)
        # Positions as generate() counts them with left padding: the first real token is at position 0.
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with self._autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        # logits[:, t] predicts token t + 1: the completion's tokens are predicted from prompt_len - 1 to -2.
        logits = logits[:, prompt_len - 1 : -1]
        if self.config.logps_backend == "grpo_ext":
            # The hand-written kernel: float32 log-probs and entropy with no [N, T, V] log-softmax temporary.
            selected = grpo_ext.selective_log_softmax(
                logits, batch["completion_ids"], temperature=self.config.temperature, return_entropy=with_entropy
            )
            return (selected.logps, selected.entropy.detach()) if with_entropy else selected.logps
        logits = logits.float() / self.config.temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        logps = log_probs.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logps
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return logps, entropy

    def _rollout(self, num_prompts: int) -> dict[str, Any]:
        """Sample ``G`` completions for each of ``num_prompts`` new prompts and score them.

        Returns:
            A dict of rows: ``prompt_ids``/``prompt_mask`` ``[N, Lp]``, ``completion_ids``/``completion_mask``
            ``[N, T]``, ``truncated [N]``, ``rewards [N, K]`` float32 (NaN: not scored), and the lists ``prompts``
            and ``completions`` (``N = num_prompts * G``).
        """
        group = self.config.num_generations
        rows = self._next_prompt_rows(num_prompts)
        prompts = [row["prompt"] for row in rows]
        prompt_ids, prompt_mask, completion_ids, completion_mask, truncated = self.generate(prompts, group)
        completions = self.decode_completions(completion_ids, completion_mask)

        repeated_prompts = [p for p in prompts for _ in range(group)]
        columns: dict[str, list] = {}
        for key in rows[0]:
            if key != "prompt":
                columns[key] = [row.get(key) for row in rows for _ in range(group)]
        columns["completion_truncated"] = truncated.tolist()
        rewards = torch.empty(len(completions), len(self.reward_funcs), dtype=torch.float32)
        for k, func in enumerate(self.reward_funcs):
            values = func(repeated_prompts, completions, **columns)
            if len(values) != len(completions):
                raise ValueError(
                    f"reward function {self.reward_names[k]} returned {len(values)} values for {len(completions)} "
                    "completions"
                )
            rewards[:, k] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "truncated": truncated, "rewards": rewards.to(self.device),
            "prompts": repeated_prompts, "completions": completions,
        }  # fmt: skip

    def _advantages(self, rewards: Tensor):
        cfg = self.config
        return grpo_ext.group_advantages(
            rewards, cfg.num_generations, reward_weights=cfg.reward_weights, scale_rewards=cfg.scale_rewards
        )

    def _dynamic_rollout(self, num_prompts: int) -> tuple[dict[str, Any], int]:
        """DAPO dynamic sampling: keep only groups whose rewards differ, sampling more prompts until enough.

        After ``max_sampling_rounds`` rounds the batch is filled with zero-std groups of the last round.

        Returns:
            The rollout dict of ``num_prompts`` groups (as :meth:`_rollout`) and the number of rounds used.
        """
        group = self.config.num_generations
        kept: list[dict[str, Any]] = []
        num_kept, rounds, last = 0, 0, None
        while num_kept < num_prompts and rounds < self.config.max_sampling_rounds:
            last = self._rollout(num_prompts - num_kept)
            rounds += 1
            varied = ~self._advantages(last["rewards"]).zero_std
            kept.append(_select_groups(last, varied, group))
            num_kept += int(varied.sum().item())
        if num_kept < num_prompts:
            flat = self._advantages(last["rewards"]).zero_std
            fill = flat & (flat.cumsum(0) <= num_prompts - num_kept)
            kept.append(_select_groups(last, fill, group))
        return _concat_rollouts(kept, self.tokenizer.pad_token_id), rounds

    @torch.no_grad()
    def _generate_and_score(self) -> None:
        """One generation batch: sample, score, compute advantages and frozen log-probs, queue the micro-batches."""
        cfg = self.config
        group = cfg.num_generations
        num_prompts = cfg.generation_batch_size // group
        if cfg.dynamic_sampling:
            rollout, rounds = self._dynamic_rollout(num_prompts)
        else:
            rollout, rounds = self._rollout(num_prompts), 1
        prompt_ids, prompt_mask = rollout["prompt_ids"], rollout["prompt_mask"]
        completion_ids, completion_mask = rollout["completion_ids"], rollout["completion_mask"]
        truncated, rewards = rollout["truncated"], rollout["rewards"]
        repeated_prompts, completions = rollout["prompts"], rollout["completions"]
        adv = self._advantages(rewards)

        if cfg.mask_truncated_completions:
            completion_mask = completion_mask & ~truncated.unsqueeze(1)
        full = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv.advantages,
            "zero_std": adv.zero_std.repeat_interleave(group),
        }  # fmt: skip
        chunk = cfg.per_device_train_batch_size
        micro = [{k: v[i : i + chunk] for k, v in full.items()} for i in range(0, len(completions), chunk)]
        for mb in micro:
            mb["old_logps"] = self.token_logps(self.model, mb) if self.needs_old_logps else None
            mb["ref_logps"] = self.token_logps(self.ref_model, mb) if self.ref_model is not None else None
        # Each iteration passes over the whole generation batch before the next one (as TRL does).
        self._micro_batches.extend(mb for _ in range(cfg.num_iterations) for mb in micro)

        weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.reward_funcs), device=self.device)
        total = (rewards * weights).nansum(dim=1)
        lengths = completion_mask.sum(dim=1).float()
        terminated = lengths[~truncated]
        self._rollout_metrics = {
            "reward": total.mean().item(),
            "reward_std": adv.group_std.mean().item(),
            "frac_reward_zero_std": adv.zero_std.float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item() if terminated.numel() else 0.0,
            "num_tokens": float(prompt_mask.sum().item() + lengths.sum().item()),
        }
        if cfg.dynamic_sampling:
            self._rollout_metrics["sampling_rounds"] = float(rounds)
        for k, name in enumerate(self.reward_names):
            column = rewards[:, k]
            valid = column[~column.isnan()]
            self._rollout_metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else math.nan
            self._rollout_metrics[f"rewards/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
        self._sample_completions = list(zip(repeated_prompts, completions, total.tolist(), strict=True))

    # ------------------------------------------------------------------------------------------------------------
    # Optimization
    # ------------------------------------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, Any]:
        if not self._micro_batches:
            self._generate_and_score()
        return self._micro_batches.pop(0)

    def _training_step(self) -> dict[str, float]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns its metrics."""
        cfg = self.config
        micro = [self._next_micro_batch() for _ in range(cfg.gradient_accumulation_steps)]
        token_level = cfg.loss_type in TOKEN_LEVEL_LOSS_TYPES
        use_sample_mask = cfg.beta != 0 and cfg.mask_zero_std_groups

        def kept_rows(mb: dict[str, Any]) -> Tensor | None:
            return ~mb["zero_std"] if use_sample_mask else None

        num_items = None
        if token_level:
            # The token-level losses average over every token of the optimizer step, not per micro-batch.
            num_items = sum(
                (mb["completion_mask"] & kept_rows(mb).unsqueeze(1) if use_sample_mask else mb["completion_mask"])
                .sum()
                .item()
                for mb in micro
            )
            num_items = max(num_items, 1)
        loss_scale = 1.0 if token_level else 1.0 / len(micro)

        self.model.train()
        sums: dict[str, float] = {}
        loss_total, entropy_total, entropy_count = 0.0, 0.0, 0
        for mb in micro:
            logps, entropy = self.token_logps(self.model, mb, with_entropy=True)
            out = grpo_ext.grpo_loss(
                logps, mb["advantages"], mb["completion_mask"], old_logps=mb["old_logps"], ref_logps=mb["ref_logps"],
                sample_mask=kept_rows(mb), loss_type=cfg.loss_type, epsilon=cfg.epsilon,
                epsilon_high=cfg.epsilon_high, delta=cfg.delta, beta=self.beta, kl_estimator=cfg.kl_estimator,
                importance_sampling_level=cfg.importance_sampling_level,
                max_completion_length=cfg.max_completion_length, num_items_in_batch=num_items, loss_scale=loss_scale,
            )  # fmt: skip
            out.loss.backward()
            loss_total += out.loss.item()
            for name, value in out.metrics.items():
                sums[name] = sums.get(name, 0.0) + value.item()
            mask = mb["completion_mask"]
            entropy_total += entropy[mask].sum().item()
            entropy_count += int(mask.sum().item())

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if cfg.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        else:
            grad_norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        metrics = {name: total / len(micro) for name, total in sums.items()}
        if self.beta != 0:
            metrics["beta"] = self.beta
        if cfg.kl_target is not None:
            self._update_beta(metrics["kl"])
        metrics.update(
            loss=loss_total, grad_norm=grad_norm, learning_rate=learning_rate,
            entropy=entropy_total / max(entropy_count, 1),
        )  # fmt: skip
        return metrics

    def _update_beta(self, kl: float) -> None:
        """Adaptive KL control: scale beta by ``1 + clip(kl / target - 1, +-0.2) / horizon`` after each step."""
        error = min(max(kl / self.config.kl_target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error / self.config.kl_horizon

    def train(self, resume_from_checkpoint: str | bool | None = None) -> list[dict[str, float]]:
        """Run until ``config.max_steps`` optimizer steps (or ``config.max_time_s``).

        Args:
            resume_from_checkpoint: a checkpoint folder, or True for the latest ``checkpoint-N`` in ``output_dir``.

        Returns:
            The logged metrics, one dict per logged step (also in ``output_dir/metrics.jsonl``).
        """
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                path = self.latest_checkpoint()
                if path is None:
                    raise FileNotFoundError(f"no checkpoint-N folder in {self.output_dir} to resume from")
            self.load_checkpoint(path)
        self._truncate_metrics_file(self.global_step)
        self._open_tensorboard()
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        bar = tqdm(
            total=cfg.max_steps, initial=self.global_step, disable=cfg.disable_tqdm, desc="GRPO", unit="step",
            mininterval=0.1 if sys.stderr.isatty() else 10.0,  # a log file gets a line every 10 s, not 10 a second
        )  # fmt: skip
        try:
            while self.global_step < cfg.max_steps:
                step_start = time.perf_counter()
                metrics = self._training_step()
                self.global_step += 1
                metrics.update(self._rollout_metrics)
                metrics["step_time"] = time.perf_counter() - step_start
                metrics["tokens_per_second"] = self._rollout_metrics["num_tokens"] / metrics["step_time"]
                metrics["step"] = self.global_step
                bar.update(1)
                if self.global_step % cfg.logging_steps == 0 or self.global_step == cfg.max_steps:
                    self._log(metrics)
                    history.append(metrics)
                    bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                if cfg.log_completions and self.global_step % cfg.log_completions_steps == 0:
                    self._print_completions()
                if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                    self.save_checkpoint()
                if cfg.max_time_s is not None and time.perf_counter() - start > cfg.max_time_s:
                    tqdm.write(f"stopping at step {self.global_step}: max_time_s={cfg.max_time_s} reached")
                    break
        finally:
            bar.close()
            if self._tb_writer is not None:
                self._tb_writer.close()
                self._tb_writer = None
        if cfg.plot:
            plot_metrics(self.metrics_path, self.plot_path)
        return history

    # ------------------------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------------------------

    def _open_tensorboard(self) -> None:
        if self.config.report_to != "tensorboard":
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb_writer = SummaryWriter(log_dir=str(self.output_dir / "runs"), purge_step=self.global_step + 1)

    def _log(self, metrics: dict[str, float]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
        if self._tb_writer is not None:
            for name, value in metrics.items():
                if name != "step":
                    self._tb_writer.add_scalar(f"train/{name}", value, self.global_step)

    def _truncate_metrics_file(self, step: int) -> None:
        """Drop lines logged after ``step`` (by a run that died after its last checkpoint)."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def _print_completions(self) -> None:
        for prompt, completion, reward in self._sample_completions[: self.config.num_completions_to_print]:
            tqdm.write(f"[step {self.global_step}] {prompt!r} -> {completion!r} (reward {reward:.3f})")

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def latest_checkpoint(self) -> Path | None:
        """The ``checkpoint-N`` folder of ``output_dir`` with the largest N, or None."""
        if not self.output_dir.is_dir():
            return None
        found = [(int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CHECKPOINT_RE.match(p.name))]
        return max(found)[1] if found else None

    def save_checkpoint(self) -> Path:
        """Write ``output_dir/checkpoint-<step>`` atomically (a temp folder renamed into place) and return it."""
        final = self.output_dir / f"checkpoint-{self.global_step}"
        tmp = self.output_dir / f".tmp-checkpoint-{self.global_step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(tmp)
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(tmp)
        torch.save({"model": self.model.state_dict()}, tmp / "model_state.pt")
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            rng["numpy"] = np.random.get_state()  # noqa: NPY002
        except ImportError:
            pass
        state = {
            "step": self.global_step, "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(), "rng": rng, "micro_batches": self._micro_batches,
            "rollout_metrics": self._rollout_metrics, "prompt_order": self._prompt_order,
            "prompt_pos": self._prompt_pos, "beta": self.beta, "config": self.config.to_dict(),
        }  # fmt: skip
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "config.grpo.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune_checkpoints()
        return final

    def _prune_checkpoints(self) -> None:
        limit = self.config.save_total_limit
        if limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CHECKPOINT_RE.match(p.name)))
        for _, path in found[:-limit]:
            shutil.rmtree(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, RNG states, queued rollouts and step from a checkpoint folder."""
        path = Path(path)
        model_state = torch.load(path / "model_state.pt", map_location=self.device, weights_only=False)
        self.model.load_state_dict(model_state["model"])
        state = torch.load(path / "trainer_state.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step = state["step"]
        self._micro_batches = state["micro_batches"]
        self._rollout_metrics = state["rollout_metrics"]
        self._prompt_order = state["prompt_order"]
        self._prompt_pos = state["prompt_pos"]
        self.beta = state["beta"]
        rng = state["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"].cpu())
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
        if "numpy" in rng:
            import numpy as np

            np.random.set_state(rng["numpy"])  # noqa: NPY002


def _select_groups(rollout: dict[str, Any], keep_groups: Tensor, group: int) -> dict[str, Any]:
    """The rows of ``rollout`` whose group is marked in ``keep_groups [N / G]`` bool."""
    rows = keep_groups.repeat_interleave(group)
    index = rows.nonzero().squeeze(1)
    picked = index.tolist()
    return {
        key: [value[i] for i in picked] if isinstance(value, list) else value[index.to(value.device)]
        for key, value in rollout.items()
    }


def _concat_rollouts(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate rollouts of different widths: prompts left-padded, completions right-padded."""
    prompt_width = max(p["prompt_ids"].shape[1] for p in parts)
    completion_width = max(p["completion_ids"].shape[1] for p in parts)

    def pad(t: Tensor, width: int, left: bool, value: int | bool) -> Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return {
        "prompt_ids": torch.cat([pad(p["prompt_ids"], prompt_width, True, pad_token_id) for p in parts]),
        "prompt_mask": torch.cat([pad(p["prompt_mask"], prompt_width, True, 0) for p in parts]),
        "completion_ids": torch.cat([pad(p["completion_ids"], completion_width, False, pad_token_id) for p in parts]),
        "completion_mask": torch.cat([pad(p["completion_mask"], completion_width, False, False) for p in parts]),
        "truncated": torch.cat([p["truncated"] for p in parts]),
        "rewards": torch.cat([p["rewards"] for p in parts]),
        "prompts": [x for p in parts for x in p["prompts"]],
        "completions": [x for p in parts for x in p["completions"]],
    }


PLOTTED_METRICS = (
    ("reward", "reward"),
    ("kl", "KL"),
    ("loss", "loss"),
    ("clip_ratio/region_mean", "clip ratio"),
    ("completions/mean_length", "completion length"),
)


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path:
    """Plot reward, KL, loss, clip ratio and completion length against step from a metrics JSONL file.

    Returns:
        The PNG's path. A metric never logged (e.g. ``kl`` when ``beta == 0``) gets an empty panel saying so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(PLOTTED_METRICS), figsize=(4 * len(PLOTTED_METRICS), 3.2))
    for ax, (key, title) in zip(axes, PLOTTED_METRICS, strict=True):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, linewidth=0.8)
        else:
            note = "not computed (beta = 0)" if key == "kl" else "not logged"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
