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
from transformers import LogitsProcessor, LogitsProcessorList

import grpo_ext

from ..ops.options import TOKEN_LEVEL_LOSS_TYPES
from . import distributed as dist_utils
from .config import GRPOConfig

RewardFunc = Callable[..., list]
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Metrics that depend on the wall clock: they differ between two otherwise identical runs.
TIMING_METRICS = ("step_time", "tokens_per_second")


def _reward_name(func: RewardFunc) -> str:
    return getattr(func, "__name__", type(func).__name__)


class RowSeededSampler(LogitsProcessor):
    """Draws every row's next token from that row's own uniforms (inverse-CDF sampling), for ``generate``.

    Used with greedy decoding: the returned scores are 0 at the drawn token and -inf elsewhere. The distribution is
    ``softmax(scores / temperature)`` after top-k and top-p filtering, as ``generate(do_sample=True)`` samples it,
    but a row's draw depends only on its uniforms and its own logits, not on the rest of the batch or the global RNG.

    Args:
        uniforms: ``[N, max_new_tokens]`` float64 in ``(0, 1]``: row ``i``'s draw for each completion position.
        prompt_width: padded prompt length of the batch (the completion position is the input length minus this).
        temperature: divides the logits.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens with probability >= top_p (1.0: all).
    """

    def __init__(self, uniforms: Tensor, prompt_width: int, temperature: float, top_k: int, top_p: float) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.uniforms = uniforms
        self.prompt_width = prompt_width
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(temperature)]
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """``input_ids [N, L]`` int64 (prompt and tokens so far), ``scores [N, V]`` float -> ``[N, V]``."""
        position = input_ids.shape[1] - self.prompt_width
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        # float64 cumulative sum: in float32 tokens below ~1e-7 of probability would lose their share of a large
        # vocabulary's mass.
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
        target = self.uniforms[:, position : position + 1] * cdf[:, -1:]
        # The first index whose cdf reaches the target; target > 0, so a zero-probability token is never drawn.
        token = torch.searchsorted(cdf, target).clamp_(max=scores.shape[1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, token, 0.0)


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

    Under ``torchrun`` (a default process group initialized before the trainer is built, every rank building it
    with the same arguments) the trainer runs data-parallel: DDP, or FSDP2 with ``config.fsdp``. Each rank
    generates, scores and trains on its share of every global batch (``per_device_train_batch_size`` rows per
    micro-batch); rewards are all-gathered so advantages are those of the global batch, and the loss is scaled so the
    averaged gradient equals one process's over the global batch. A run's result depends on the global batch
    (``per_device_train_batch_size * world_size``) and the seed, not on the number of processes (see
    :mod:`grpo_ext.trainer.distributed`). ``model`` must be on this rank's device; rank 0's weights are copied to
    every rank.
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

        self.world_size = dist_utils.world_size()
        self.rank = dist_utils.rank()
        self.is_main_process = self.rank == 0
        self.use_fsdp = cfg.fsdp
        if cfg.fsdp and not dist_utils.is_distributed():
            raise ValueError(
                "GRPOConfig.fsdp=True needs torch.distributed initialized (launch with torchrun, or call "
                "torch.distributed.init_process_group before building the trainer)"
            )
        if cfg.fsdp and cfg.dynamic_sampling and cfg.num_generations < self.world_size:
            # A dynamic-sampling round can be a single group; split over more ranks than rows, a rank would have
            # nothing to generate and would miss FSDP's collectives.
            raise ValueError(
                f"GRPOConfig.num_generations ({cfg.num_generations}) must be >= the world size ({self.world_size}) "
                "with fsdp=True and dynamic_sampling=True"
            )
        # Global row indices of a generation batch that this rank generates and trains on (distributed.py).
        self._local_rows = dist_utils.local_rows(
            self.rank, self.world_size, cfg.per_device_train_batch_size, cfg.steps_per_generation
        ).tolist()
        if self.world_size > 1:
            dist_utils.broadcast_module(model)  # every rank starts from rank 0's weights (DDP does it too; FSDP not)

        self.beta = cfg.beta  # moved by the adaptive KL controller when cfg.kl_target is set
        self.ref_model = None
        if cfg.beta != 0:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
            if self.world_size > 1 and ref_model is not None:
                dist_utils.broadcast_module(self.ref_model)
        # The sampling policy's log-probs are needed only when the policy can move between generation and use.
        self.needs_old_logps = cfg.num_iterations > 1 or cfg.steps_per_generation > 1

        # _train_model is what the training forward goes through: the DDP wrapper (its hooks all-reduce the
        # gradients), or the FSDP2-sharded model itself. Generation and no-grad scoring use self.model directly.
        self._train_model: torch.nn.Module = model
        self._model_class_name = type(model).__name__  # FSDP2 swaps in a generated subclass
        if cfg.fsdp:
            dist_utils.shard_fsdp(model)
            if self.ref_model is not None:
                dist_utils.shard_fsdp(self.ref_model)
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self._train_model = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

        params = [p for p in model.parameters() if p.requires_grad]
        self._param_names = [name for name, p in model.named_parameters() if p.requires_grad]  # optimizer order
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
        # Its own generator, so the prompt order is the same on every rank whatever else draws random numbers.
        self._data_generator = torch.Generator().manual_seed(cfg.seed)
        self._generation = 0  # generation rounds so far: part of every row's sampling seed
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
        """Dataset rows without replacement within an epoch, reshuffled each epoch (the same on every rank)."""
        rows = []
        while len(rows) < num_prompts:
            if self._prompt_pos >= len(self._prompt_order):
                self._prompt_order = torch.randperm(len(self.train_dataset), generator=self._data_generator).tolist()
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
        self,
        prompts: list[str],
        num_return_sequences: int,
        greedy: bool = False,
        row_seeds: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Sample completions and their masks.

        Args:
            prompts: ``[P]`` prompt strings.
            num_return_sequences: completions per prompt (contiguous rows in the output).
            greedy: argmax decoding instead of sampling (evaluation).
            row_seeds: ``N`` seeds, one per output row: row ``i`` is sampled from its own random stream seeded
                ``row_seeds[i]``, so its tokens do not depend on the other rows of the batch (up to float rounding
                of the logits). None: ``generate``'s own sampling from the global torch RNG.

        Returns:
            ``prompt_ids [N, Lp]`` int64 (left-padded), ``prompt_mask [N, Lp]`` int64, ``completion_ids [N, T]``
            int64, ``completion_mask [N, T]`` bool (tokens up to and including the first EOS) and ``truncated [N]``
            bool (no EOS within ``max_completion_length``), with ``N = P * num_return_sequences``.
        """
        cfg = self.config
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        prompt_ids = prompt_ids.repeat_interleave(num_return_sequences, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_return_sequences, dim=0)
        sampling: dict[str, Any] = {"do_sample": not greedy}
        if not greedy and row_seeds is not None:
            if len(row_seeds) != prompt_ids.shape[0]:
                raise ValueError(
                    f"row_seeds has {len(row_seeds)} seeds for {prompt_ids.shape[0]} rows "
                    f"({len(prompts)} prompts x {num_return_sequences})"
                )
            uniforms = dist_utils.row_uniforms(row_seeds, cfg.max_completion_length, self.device)
            sampler = RowSeededSampler(uniforms, prompt_ids.shape[1], cfg.temperature, cfg.top_k, cfg.top_p)
            # Greedy decoding over the sampler's output, which keeps only the token it drew.
            sampling = {"do_sample": False, "logits_processor": LogitsProcessorList([sampler])}
        elif not greedy:
            sampling.update(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        if self.use_fsdp and self.world_size > 1:
            # Sharded weights are gathered in every forward: a rank whose rows finished must keep stepping.
            sampling["synced_gpus"] = True
        was_training = self.model.training
        self.model.eval()
        with self._autocast():
            sequences = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=cfg.max_completion_length,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id, **sampling,
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

    def _rollout(self, prompt_rows: list[dict[str, Any]], rows: Sequence[int]) -> dict[str, Any] | None:
        """Sample and score some rows of one generation round.

        Row ``j`` of the round is completion ``j % G`` of ``prompt_rows[j // G]``; it is sampled from the stream
        seeded by ``(seed, round number, j)``, so the same rows come out whichever rank generates them. Every rank
        calls this once per round (the round number advances on each call).

        Args:
            prompt_rows: the round's prompts (dataset rows), the same list on every rank.
            rows: the round's row indices this rank generates (may be empty).

        Returns:
            None when ``rows`` is empty, else a dict of ``N = len(rows)`` rows: ``prompt_ids``/``prompt_mask``
            ``[N, Lp]``, ``completion_ids``/``completion_mask`` ``[N, T]``, ``truncated [N]``, ``rewards [N, K]``
            float32 (NaN: not scored), and the lists ``prompts`` and ``completions``.
        """
        group = self.config.num_generations
        generation = self._generation
        self._generation += 1
        if len(rows) == 0:
            return None
        row_prompts = [prompt_rows[j // group] for j in rows]
        prompts = [row["prompt"] for row in row_prompts]
        seeds = [dist_utils.row_seed(self.config.seed, generation, j) for j in rows]
        prompt_ids, prompt_mask, completion_ids, completion_mask, truncated = self.generate(prompts, 1, row_seeds=seeds)
        completions = self.decode_completions(completion_ids, completion_mask)

        columns: dict[str, list] = {}
        for key in prompt_rows[0]:
            if key != "prompt":
                columns[key] = [row.get(key) for row in row_prompts]
        columns["completion_truncated"] = truncated.tolist()
        rewards = torch.empty(len(completions), len(self.reward_funcs), dtype=torch.float32)
        for k, func in enumerate(self.reward_funcs):
            values = func(prompts, completions, **columns)
            if len(values) != len(completions):
                raise ValueError(
                    f"reward function {self.reward_names[k]} returned {len(values)} values for {len(completions)} "
                    "completions"
                )
            rewards[:, k] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "truncated": truncated, "rewards": rewards.to(self.device),
            "prompts": prompts, "completions": completions,
        }  # fmt: skip

    def _advantages(self, rewards: Tensor):
        cfg = self.config
        return grpo_ext.group_advantages(
            rewards, cfg.num_generations, reward_weights=cfg.reward_weights, scale_rewards=cfg.scale_rewards
        )

    def _gather_rollout(self, local: dict[str, Any] | None) -> dict[str, Any]:
        """Every rank's rows of a round, concatenated in rank order (padded to a common width), on every rank."""
        if self.world_size == 1:
            assert local is not None
            return local
        on_cpu = None if local is None else _map_tensors(local, lambda t: t.cpu())
        parts = [part for part in dist_utils.all_gather_objects(on_cpu) if part is not None]
        return _map_tensors(_concat_rollouts(parts, self.tokenizer.pad_token_id), lambda t: t.to(self.device))

    def _dynamic_rollout(self, num_prompts: int) -> tuple[dict[str, Any], int]:
        """DAPO dynamic sampling: keep only groups whose rewards differ, sampling more prompts until enough.

        After ``max_sampling_rounds`` rounds the batch is filled with zero-std groups of the last round. Each round's
        rows are split over the ranks in contiguous chunks and gathered back, so every rank decides the same.

        Returns:
            The rollout dict of ``num_prompts`` groups (as :meth:`_rollout`), the whole global generation batch on
            every rank, and the number of rounds used.
        """
        group = self.config.num_generations
        kept: list[dict[str, Any]] = []
        num_kept, rounds, last = 0, 0, None
        while num_kept < num_prompts and rounds < self.config.max_sampling_rounds:
            prompt_rows = self._next_prompt_rows(num_prompts - num_kept)
            total = len(prompt_rows) * group
            mine = range(self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size)
            last = self._gather_rollout(self._rollout(prompt_rows, mine))
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
        """One generation batch: sample, score, compute advantages and frozen log-probs, queue the micro-batches.

        This rank generates and keeps only its rows of the global generation batch (``distributed.local_rows``);
        the rewards of all rows are all-gathered, so advantages (group and batch statistics) and the logged
        rollout metrics are those of the global batch.
        """
        cfg = self.config
        group = cfg.num_generations
        per_device, steps = cfg.per_device_train_batch_size, cfg.steps_per_generation
        num_prompts = per_device * steps * self.world_size // group
        if cfg.dynamic_sampling:
            everything, rounds = self._dynamic_rollout(num_prompts)
            rollout = _select_rows(everything, torch.tensor(self._local_rows))
        else:
            rollout, rounds = self._rollout(self._next_prompt_rows(num_prompts), self._local_rows), 1
        prompt_ids, prompt_mask = rollout["prompt_ids"], rollout["prompt_mask"]
        completion_ids, completion_mask = rollout["completion_ids"], rollout["completion_mask"]
        truncated, rewards = rollout["truncated"], rollout["rewards"]
        if cfg.mask_truncated_completions:
            completion_mask = completion_mask & ~truncated.unsqueeze(1)

        # One all_gather of every per-row number the advantages and the logged metrics need.
        num_rewards = rewards.shape[1]
        row_stats = torch.cat(
            [rewards, completion_mask.sum(dim=1, keepdim=True).float(), truncated.unsqueeze(1).float(),
             prompt_mask.sum(dim=1, keepdim=True).float()], dim=1,
        )  # fmt: skip
        all_stats = dist_utils.gather_rows(row_stats, self.world_size, per_device, steps)
        all_rewards = all_stats[:, :num_rewards]
        adv = self._advantages(all_rewards)
        mine = torch.tensor(self._local_rows, device=self.device)

        full = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv.advantages[mine],
            "zero_std": adv.zero_std.repeat_interleave(group)[mine],
        }  # fmt: skip
        micro = [{k: v[i : i + per_device] for k, v in full.items()} for i in range(0, len(mine), per_device)]
        for mb in micro:
            mb["old_logps"] = self.token_logps(self.model, mb) if self.needs_old_logps else None
            mb["ref_logps"] = self.token_logps(self.ref_model, mb) if self.ref_model is not None else None
        # Each iteration passes over the whole generation batch before the next one (as TRL does).
        self._micro_batches.extend(mb for _ in range(cfg.num_iterations) for mb in micro)

        weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.reward_funcs), device=self.device)
        total = (all_rewards * weights).nansum(dim=1)
        lengths = all_stats[:, num_rewards]
        all_truncated = all_stats[:, num_rewards + 1].bool()
        terminated = lengths[~all_truncated]
        self._rollout_metrics = {
            "reward": total.mean().item(),
            "reward_std": adv.group_std.mean().item(),
            "frac_reward_zero_std": adv.zero_std.float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": all_truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item() if terminated.numel() else 0.0,
            "num_tokens": all_stats[:, num_rewards + 2].sum().item() + lengths.sum().item(),
        }
        if cfg.dynamic_sampling:
            self._rollout_metrics["sampling_rounds"] = float(rounds)
        for k, name in enumerate(self.reward_names):
            column = all_rewards[:, k]
            valid = column[~column.isnan()]
            self._rollout_metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else math.nan
            self._rollout_metrics[f"rewards/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
        local_total = total[mine].tolist()
        self._sample_completions = list(zip(rollout["prompts"], rollout["completions"], local_total, strict=True))

    # ------------------------------------------------------------------------------------------------------------
    # Optimization
    # ------------------------------------------------------------------------------------------------------------

    def _next_micro_batch(self) -> dict[str, Any]:
        if not self._micro_batches:
            self._generate_and_score()
        return self._micro_batches.pop(0)

    def _grad_sync(self, enabled: bool):
        """Context of one micro-batch's forward and backward: gradients are reduced across ranks only if enabled."""
        if self.use_fsdp:
            self.model.set_requires_gradient_sync(enabled)
            return nullcontext()
        if enabled or self._train_model is self.model:
            return nullcontext()
        return self._train_model.no_sync()  # DDP: accumulate locally, all-reduce with the last micro-batch

    def _training_step(self) -> dict[str, float]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns its metrics.

        The metrics are those of the global step: summed over ranks, token-weighted (``kl``, clip ratios: each
        micro-batch's share weighted by its tokens, or rows for sequence-level ratios), the same on every rank.
        """
        cfg = self.config
        micro = [self._next_micro_batch() for _ in range(cfg.gradient_accumulation_steps)]
        use_sample_mask = cfg.beta != 0 and cfg.mask_zero_std_groups

        def kept_rows(mb: dict[str, Any]) -> Tensor | None:
            return ~mb["zero_std"] if use_sample_mask else None

        def loss_tokens(mb: dict[str, Any]) -> Tensor:
            mask = mb["completion_mask"]
            return (mask & kept_rows(mb).unsqueeze(1) if use_sample_mask else mask).sum()

        # Tokens entering the loss (masked zero-std rows excluded): this rank's per micro-batch, [M] int64, and the
        # whole step's on all ranks (one all-reduce, one host sync per step).
        counts = torch.stack([loss_tokens(mb) for mb in micro]).long()
        total_tokens = dist_utils.all_reduce_sum(counts.sum().reshape(1))
        counts_list = counts.tolist()
        step_tokens = max(int(total_tokens.item()), 1)

        # Loss scaling. DDP and FSDP average the gradients of the W ranks, so each rank's loss is W times its
        # share of the loss of the global step (M micro-batches on each of W ranks):
        # - grpo, sapo, luspo, dr_grpo: the op divides by the micro-batch's rows B (dr_grpo: B * max_completion_length),
        #   the same on every rank; the global denominator is M * W * B, so loss_scale = W / (M * W) = 1 / M.
        # - dapo, cispo: num_items_in_batch is the step's token count over all ranks and micro-batches; loss_scale = W.
        # - bnpo: the op divides by the micro-batch's own tokens n_k; loss_scale = W * n_k / N turns that into / N.
        num_micro, world = len(micro), self.world_size
        token_level = cfg.loss_type in TOKEN_LEVEL_LOSS_TYPES

        def scale_of(k: int) -> float:
            if token_level:
                return float(world)
            if cfg.loss_type == "bnpo":
                return world * counts_list[k] / step_tokens
            return 1.0 / num_micro

        self._train_model.train()
        per_row_ratios = cfg.importance_sampling_level == "sequence"  # clip ratios are shares of rows (spec 7)
        metric_sums: dict[str, Tensor] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        entropy_total = torch.zeros((), dtype=torch.float64, device=self.device)
        entropy_count = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, mb in enumerate(micro):
            with self._grad_sync(k == num_micro - 1):
                logps, entropy = self.token_logps(self._train_model, mb, with_entropy=True)
                out = grpo_ext.grpo_loss(
                    logps, mb["advantages"], mb["completion_mask"], old_logps=mb["old_logps"],
                    ref_logps=mb["ref_logps"], sample_mask=kept_rows(mb), loss_type=cfg.loss_type,
                    epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta, beta=self.beta,
                    kl_estimator=cfg.kl_estimator, importance_sampling_level=cfg.importance_sampling_level,
                    max_completion_length=cfg.max_completion_length,
                    num_items_in_batch=step_tokens if token_level else None, loss_scale=scale_of(k),
                )  # fmt: skip
                out.loss.backward()
            loss_total += out.loss.detach()
            rows = mb["completion_mask"].shape[0]
            for name, value in out.metrics.items():
                weight = rows if per_row_ratios and name != "kl" else counts_list[k]
                metric_sums[name] = metric_sums.get(name, 0.0) + value.double() * weight
            mask = mb["completion_mask"]
            entropy_total += entropy[mask].sum().double()
            entropy_count += mask.sum()

        names = list(metric_sums)  # the op's order, the same on every rank
        packed = torch.stack([loss_total, entropy_total, entropy_count, *(metric_sums[n] for n in names)])
        packed = dist_utils.all_reduce_sum(packed).tolist()
        row_total = world * num_micro * micro[0]["completion_mask"].shape[0]
        metrics = {
            name: value / (row_total if per_row_ratios and name != "kl" else step_tokens)
            for name, value in zip(names, packed[3:], strict=True)
        }

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.use_fsdp:
            # DTensor gradients: clip_grad_norm_ reduces the shards' norms across ranks (inf: measure only).
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
            grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        elif cfg.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        else:
            grad_norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        if self.beta != 0:
            metrics["beta"] = self.beta
        if cfg.kl_target is not None:
            self._update_beta(metrics["kl"])  # a global kl: beta stays the same on every rank
        metrics.update(
            loss=packed[0] / world, grad_norm=grad_norm, learning_rate=learning_rate,
            entropy=packed[1] / max(packed[2], 1.0),
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
            The logged metrics, one dict per logged step (also in ``output_dir/metrics.jsonl``). Under
            torch.distributed every rank returns them; only rank 0 writes files, TensorBoard events and progress.
        """
        cfg = self.config
        if self.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                # Rank 0's view of output_dir decides (other machines need not share its file system).
                path = dist_utils.broadcast_object(self.latest_checkpoint() if self.is_main_process else None)
                if path is None:
                    raise FileNotFoundError(f"no checkpoint-N folder in {self.output_dir} to resume from")
            self.load_checkpoint(path)
        if self.is_main_process:
            self._truncate_metrics_file(self.global_step)
            self._open_tensorboard()
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        bar = tqdm(
            total=cfg.max_steps, initial=self.global_step, disable=cfg.disable_tqdm or not self.is_main_process,
            desc="GRPO", unit="step",
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
                    if self.is_main_process:
                        self._log(metrics)
                    history.append(metrics)
                    bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                if cfg.log_completions and self.global_step % cfg.log_completions_steps == 0 and self.is_main_process:
                    self._print_completions()
                if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                    self.save_checkpoint()
                if cfg.max_time_s is not None and self._out_of_time(start):
                    if self.is_main_process:
                        tqdm.write(f"stopping at step {self.global_step}: max_time_s={cfg.max_time_s} reached")
                    break
        finally:
            bar.close()
            if self._tb_writer is not None:
                self._tb_writer.close()
                self._tb_writer = None
        if cfg.plot and self.is_main_process:
            plot_metrics(self.metrics_path, self.plot_path)
        dist_utils.barrier()  # rank 0's files are complete when train() returns on any rank
        return history

    def _out_of_time(self, start: float) -> bool:
        """Whether ``max_time_s`` has passed, by rank 0's clock: every rank must stop at the same step."""
        late = time.perf_counter() - start > self.config.max_time_s
        if self.world_size == 1:
            return late
        flag = torch.tensor([float(late)], device=self.device)
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item())

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
        """Write ``output_dir/checkpoint-<step>`` atomically (a temp folder renamed into place) and return it.

        Under torch.distributed every rank must call it: the full (unsharded) state and every rank's queued
        micro-batches are gathered, rank 0 alone writes, and no rank returns before the folder is in place.
        """
        final = self.output_dir / f"checkpoint-{self.global_step}"
        model_state, optimizer_state = self._full_state_dicts()
        queue = [_map_tensors(mb, lambda t: t.cpu()) for mb in self._micro_batches]
        queues = dist_utils.gather_objects(queue)  # rank order; None on ranks other than 0
        if self.is_main_process:
            tmp = self.output_dir / f".tmp-checkpoint-{self.global_step}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            torch.save({"model": model_state}, tmp / "model_state.pt")
            if hasattr(self.model, "save_pretrained"):
                # A copy: save_pretrained takes entries out of the dict it is given.
                self.model.save_pretrained(tmp, state_dict=dict(model_state))
                if self.use_fsdp:
                    _fix_saved_architecture(tmp, self._model_class_name)
                if hasattr(self.tokenizer, "save_pretrained"):
                    self.tokenizer.save_pretrained(tmp)
            rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            try:
                import numpy as np

                rng["numpy"] = np.random.get_state()  # noqa: NPY002
            except ImportError:
                pass
            rng["data"] = self._data_generator.get_state()
            state = {
                "step": self.global_step, "optimizer": optimizer_state,
                "lr_scheduler": self.lr_scheduler.state_dict(), "rng": rng, "micro_batches_by_rank": queues,
                "world_size": self.world_size, "rollout_metrics": self._rollout_metrics,
                "prompt_order": self._prompt_order, "prompt_pos": self._prompt_pos, "generation": self._generation,
                "beta": self.beta, "config": self.config.to_dict(),
            }  # fmt: skip
            torch.save(state, tmp / "trainer_state.pt")
            (tmp / "config.grpo.json").write_text(json.dumps(self.config.to_dict(), indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune_checkpoints()
        dist_utils.barrier()
        return final

    def _full_state_dicts(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The model's and the optimizer's full state dicts on rank 0 (None elsewhere); a collective under FSDP.

        The optimizer's is in ``torch.optim``'s own format (parameters by index), whatever the wrapping, so a
        checkpoint can be resumed with or without FSDP.
        """
        if self.use_fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
            model_state = get_model_state_dict(self.model, options=options)
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            if not self.is_main_process:
                return None, None
            return model_state, _optimizer_state_by_index(optimizer_state, self._param_names)
        if not self.is_main_process:
            return None, None
        return self.model.state_dict(), self.optimizer.state_dict()

    def _prune_checkpoints(self) -> None:
        limit = self.config.save_total_limit
        if limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CHECKPOINT_RE.match(p.name)))
        for _, path in found[:-limit]:
            shutil.rmtree(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, RNG states, queued rollouts and step from a checkpoint folder.

        Under torch.distributed every rank calls it; rank 0 reads the folder and sends the state to the others
        (they need not see the files). The checkpoint may come from another number of processes if the global batch
        is the same: ``per_device_train_batch_size * world_size`` must equal the saving run's. Queued micro-batches
        are then re-cut into this run's per-rank slices (the same rows per global micro-batch, so the same updates
        up to float rounding; with the saving run's world size they are restored bit for bit).

        Raises:
            ValueError: naming ``per_device_train_batch_size`` when the global batch differs or this world size
                does not divide it.
        """
        path = Path(path)
        distributed = self.world_size > 1
        location = "cpu" if distributed else self.device
        model_state, state = None, None
        if self.is_main_process:
            model_state = torch.load(path / "model_state.pt", map_location=location, weights_only=False)["model"]
            state = torch.load(path / "trainer_state.pt", map_location=location, weights_only=False)
        if self.use_fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, model_state if self.is_main_process else {}, options=options)
            optimizer_state = state.pop("optimizer") if self.is_main_process else None
            state = dist_utils.broadcast_object(state)
            by_name = _optimizer_state_by_name(optimizer_state, self._param_names) if self.is_main_process else {}
            set_optimizer_state_dict(self.model, self.optimizer, by_name, options=options)
        else:
            if self.is_main_process:
                self.model.load_state_dict(model_state)
            if distributed:
                dist_utils.broadcast_module(self.model)
            state = dist_utils.broadcast_object(state)
            self.optimizer.load_state_dict(state["optimizer"])
        del model_state

        saved_world = state.get("world_size", 1)
        saved_per_device = state["config"]["per_device_train_batch_size"]
        per_device = check_resume_batch(saved_per_device * saved_world, self.world_size, self.config)
        queues = state.get("micro_batches_by_rank") or [state["micro_batches"]]  # (a checkpoint of one process)
        if saved_world == self.world_size and saved_per_device == per_device:
            queue = queues[self.rank]
        else:
            queue = _reshard_queues(queues, self.rank, per_device, self.tokenizer.pad_token_id)
        self._micro_batches = [_map_tensors(mb, lambda t: t.to(self.device)) for mb in queue]

        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step = state["step"]
        self._rollout_metrics = state["rollout_metrics"]
        self._prompt_order = state["prompt_order"]
        self._prompt_pos = state["prompt_pos"]
        self._generation = state.get("generation", 0)
        self.beta = state["beta"]
        rng = state["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"].cpu())
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
        if "numpy" in rng:
            import numpy as np

            np.random.set_state(rng["numpy"])  # noqa: NPY002
        if "data" in rng:
            self._data_generator.set_state(rng["data"].cpu())


def check_resume_batch(saved_global_batch: int, world_size: int, config: GRPOConfig) -> int:
    """Checks that a checkpoint of global batch ``saved_global_batch`` can be resumed on ``world_size`` processes.

    Args:
        saved_global_batch: ``per_device_train_batch_size * world_size`` of the run that saved the checkpoint.
        world_size: this run's number of processes.
        config: this run's options.

    Returns:
        The per-process batch, ``config.per_device_train_batch_size``.

    Raises:
        ValueError: naming ``per_device_train_batch_size`` (and the world size when it does not divide the batch).
    """
    per_device = config.per_device_train_batch_size
    if saved_global_batch % world_size != 0:
        raise ValueError(
            f"cannot resume on world_size={world_size} processes: the checkpoint's global batch "
            f"(per_device_train_batch_size x world_size = {saved_global_batch}) is not divisible by {world_size}"
        )
    if per_device * world_size != saved_global_batch:
        raise ValueError(
            f"GRPOConfig.per_device_train_batch_size must be {saved_global_batch // world_size} to resume this "
            f"checkpoint on {world_size} process(es) (its global batch is {saved_global_batch}), got {per_device}"
        )
    return per_device


def _map_tensors(rows: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    return {key: fn(value) if isinstance(value, Tensor) else value for key, value in rows.items()}


def _optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch.distributed.checkpoint's optimizer state (parameters by name) -> ``Optimizer.state_dict()``'s format."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]],
    }


def _optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_optimizer_state_by_index`."""
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _fix_saved_architecture(folder: Path, class_name: str) -> None:
    """save_pretrained records the model's class; under FSDP2 that is the generated ``FSDP<Class>`` subclass,
    which ``from_pretrained`` would not know: write the original name back."""
    config_path = folder / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        config["architectures"] = [class_name]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _reshard_queues(queues: list[list[dict[str, Any]]], rank: int, per_device: int, pad_token_id: int):
    """Queued micro-batches saved by ``len(queues)`` ranks, re-cut for ``rank`` of a run with ``per_device`` rows.

    Position ``q`` of every saved queue is one global micro-batch (saved ranks in order); this rank takes rows
    ``[rank * per_device, (rank + 1) * per_device)`` of it, as distributed.local_rows lays out a fresh batch.
    """
    if len({len(queue) for queue in queues}) > 1:
        raise ValueError("corrupt checkpoint: the ranks' queued micro-batch counts differ")
    out = []
    for position in range(len(queues[0])):
        merged = _concat_rollouts([queue[position] for queue in queues], pad_token_id)
        rows = slice(rank * per_device, (rank + 1) * per_device)
        out.append({key: None if value is None else value[rows] for key, value in merged.items()})
    return out


def _select_rows(rollout: dict[str, Any], index: Tensor) -> dict[str, Any]:
    """The rows ``index [n]`` int64 of ``rollout`` (tensors and lists alike), in that order."""
    picked = index.tolist()
    return {
        key: [value[i] for i in picked] if isinstance(value, list) else value[index.to(value.device)]
        for key, value in rollout.items()
    }


def _select_groups(rollout: dict[str, Any], keep_groups: Tensor, group: int) -> dict[str, Any]:
    """The rows of ``rollout`` whose group is marked in ``keep_groups [N / G]`` bool."""
    return _select_rows(rollout, keep_groups.repeat_interleave(group).nonzero().squeeze(1))


# Padding of the [N, width] entries of rollouts and micro-batches when rows of different widths are concatenated:
# prompts on the left (generation appends on the right), completions and their per-token values on the right.
_LEFT_PAD = {"prompt_ids": None, "prompt_mask": 0}  # None: the tokenizer's pad token
_RIGHT_PAD = {"completion_ids": None, "completion_mask": False, "old_logps": 0.0, "ref_logps": 0.0}


def _concat_rollouts(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate rollouts (or micro-batches) of different widths: prompts left-padded, completions right-padded.

    Entries that are None in the parts (``old_logps`` when not needed) stay None; lists are concatenated.
    """

    def pad(t: Tensor, width: int, left: bool, value: float | bool | None) -> Tensor:
        extra = width - t.shape[1]
        value = pad_token_id if value is None else value
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    out: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if first is None:
            out[key] = None
        elif isinstance(first, list):
            out[key] = [x for value in values for x in value]
        elif key in _LEFT_PAD or key in _RIGHT_PAD:
            left = key in _LEFT_PAD
            width = max(v.shape[1] for v in values)
            fill = _LEFT_PAD[key] if left else _RIGHT_PAD[key]
            out[key] = torch.cat([pad(v, width, left, fill) for v in values])
        else:
            out[key] = torch.cat(values)
    return out


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
