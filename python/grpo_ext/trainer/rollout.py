"""Rollouts of GRPOTrainer: prompt order, ``model.generate`` with per-row seeds, scoring, DAPO dynamic sampling.

The prompts' token ids are in ``prompts.py``, the sampler in ``sampling.py``, the batches' row helpers in
``batches.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from .. import ops
from ..results import GroupAdvantages
from . import distributed as dist_utils
from .batches import concat_rollouts, map_tensors, select_groups, select_rows
from .config import GRPOConfig
from .metrics import rollout_metrics
from .prompts import Completion, Prompt, is_conversational, message_text, prompt_token_ids, stop_token_ids
from .sampling import NEUTRAL_GENERATION, NEUTRAL_SAMPLING, RowSeededSampler, bf16_autocast

# score(prompts, completions, columns) -> rewards [N, K] float32 (NaN: not scored), K reward functions.
ScoreFunc = Callable[[list[Prompt], list[Completion], dict[str, list]], Tensor]


def group_advantages(rewards: Tensor, config: GRPOConfig) -> GroupAdvantages:
    """:func:`grpo_ext.group_advantages` of ``rewards [N, K]`` float32 with the config's group size and weights."""
    return ops.group_advantages(
        rewards, config.num_generations, reward_weights=config.reward_weights, scale_rewards=config.scale_rewards
    )


class RolloutGenerator:
    """Makes GRPOTrainer's generation batches: prompts, sampled completions, rewards, advantages, frozen log-probs.

    Prompts are drawn without replacement within an epoch, reshuffled each epoch from a generator of their own (the
    same order on every rank); every row of a round is sampled from its own seeded stream, so the same rows come out
    whichever rank generates them.

    Args:
        model: the policy (unwrapped: generation does not go through DDP).
        tokenizer: a ``transformers`` tokenizer with ``pad_token_id`` and ``eos_token_id``.
        train_dataset: a sequence of dicts with a ``prompt`` string and any other columns (given to ``score``).
        config: the options (sampling, lengths, seed, batch sizes, dynamic sampling).
        score: ``score(prompts, completions, columns) -> rewards [N, K]`` float32 (NaN: not scored).
        logps: ``logps(model, batch) -> [B, T]`` float32 per-token log-probs of a micro-batch's completions.
        ref_model: the frozen reference whose log-probs each micro-batch gets, or None (``beta == 0``).
        needs_old_logps: give each micro-batch the sampling policy's log-probs too.
        device: this rank's device.
        use_bf16: generate under bfloat16 autocast (on CUDA).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        train_dataset: Sequence[dict[str, Any]],
        config: GRPOConfig,
        score: ScoreFunc,
        logps: Callable[[torch.nn.Module, dict[str, Any]], Tensor],
        ref_model: torch.nn.Module | None,
        needs_old_logps: bool,
        device: torch.device,
        use_bf16: bool,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self._dataset_fingerprint: dict[str, Any] | None = None
        self.config = config
        self.score = score
        self.logps = logps
        self.ref_model = ref_model
        self.needs_old_logps = needs_old_logps
        self.device = device
        self.use_bf16 = use_bf16
        self.world_size = dist_utils.world_size()
        self.rank = dist_utils.rank()
        # Global row indices of a generation batch that this rank generates and trains on (distributed.py).
        self.local_rows = dist_utils.local_rows(
            self.rank, self.world_size, config.per_device_train_batch_size, config.steps_per_generation
        ).tolist()
        self.prompt_order: list[int] = []  # this epoch's shuffled dataset indices
        self.prompt_pos = 0
        # Its own generator, so the prompt order is the same on every rank whatever else draws random numbers.
        self.data_generator = torch.Generator().manual_seed(config.seed)
        self.generation = 0  # generation rounds so far: part of every row's sampling seed

    def state_dict(self) -> dict[str, Any]:
        """``prompt_order``, ``prompt_pos`` and ``generation``: where a resumed run continues (the data generator's
        state is saved with the RNG states); and ``dataset``, the training rows' count and digest."""
        return {"prompt_order": self.prompt_order, "prompt_pos": self.prompt_pos, "generation": self.generation,
                "dataset": self.dataset_fingerprint()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``generation`` 0 when absent).

        Raises:
            ValueError: naming ``dataset`` when the checkpoint's run trained on other rows (their count or digest
                differ, or its prompt order points past this dataset): it would continue on other prompts.
        """
        saved, mine = state.get("dataset"), self.dataset_fingerprint()
        past_the_end = any(i >= mine["rows"] for i in state["prompt_order"])
        if (saved is not None and saved != mine) or past_the_end:
            was = f"{saved['rows']} rows, sha256 {saved['sha256'][:12]}" if saved is not None else "more rows"
            raise ValueError(f"dataset: the checkpoint's run trained on other rows ({was}) than this run's "
                             f"({mine['rows']} rows, sha256 {mine['sha256'][:12]}): resume with the same dataset, or "
                             "start a new run from the checkpoint's model folder")  # fmt: skip
        self.prompt_order = state["prompt_order"]
        self.prompt_pos = state["prompt_pos"]
        self.generation = state.get("generation", 0)

    def dataset_fingerprint(self) -> dict[str, Any]:
        """``{"rows": N, "sha256": hex}`` of the training rows (each as sorted-key JSON), computed once."""
        if self._dataset_fingerprint is None:
            digest = hashlib.sha256()
            for row in self.train_dataset:
                digest.update(json.dumps(row, sort_keys=True, default=repr).encode())
                digest.update(b"\n")
            self._dataset_fingerprint = {"rows": len(self.train_dataset), "sha256": digest.hexdigest()}
        return self._dataset_fingerprint

    def next_prompt_rows(self, num_prompts: int) -> list[dict[str, Any]]:
        """Dataset rows without replacement within an epoch, reshuffled each epoch (the same on every rank)."""
        rows = []
        while len(rows) < num_prompts:
            if self.prompt_pos >= len(self.prompt_order):
                self.prompt_order = torch.randperm(len(self.train_dataset), generator=self.data_generator).tolist()
                self.prompt_pos = 0
            rows.append(self.train_dataset[self.prompt_order[self.prompt_pos]])
            self.prompt_pos += 1
        return rows

    def _encode_prompts(self, prompts: list[Prompt]) -> tuple[Tensor, Tensor]:
        """Left-padded ``input_ids [P, Lp]`` and ``attention_mask [P, Lp]`` int64 on the device.

        Each prompt is encoded by :func:`prompt_token_ids` (a list of messages through the tokenizer's chat template,
        a string as it is) and, with ``max_prompt_length``, cut to its last ``max_prompt_length`` tokens (the
        question usually sits at the end).
        """
        self.tokenizer.padding_side = "left"  # generation appends on the right
        rows = [prompt_token_ids(self.tokenizer, prompt) for prompt in prompts]
        if self.config.max_prompt_length is not None:
            rows = [ids[len(ids) - self.config.max_prompt_length :] if len(ids) > self.config.max_prompt_length
                    else ids for ids in rows]  # fmt: skip
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[i, width - len(ids) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

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
            prompts: ``[P]`` prompts: strings, or lists of messages (rendered with the tokenizer's chat template).
            num_return_sequences: completions per prompt (contiguous rows in the output).
            greedy: argmax decoding instead of sampling (evaluation).
            row_seeds: ``N`` seeds, one per output row: row ``i`` is sampled from its own random stream seeded
                ``row_seeds[i]``, so its tokens do not depend on the other rows of the batch (up to float rounding
                of the logits). None: ``generate``'s own sampling from the global torch RNG.

        Returns:
            ``prompt_ids [N, Lp]`` int64 (left-padded), ``prompt_mask [N, Lp]`` int64, ``completion_ids [N, T]``
            int64, ``completion_mask [N, T]`` bool (tokens up to and including the first stop token: the
            tokenizer's EOS or one of the model's ``generation_config.eos_token_id``) and ``truncated [N]``
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
            sampling.update(NEUTRAL_SAMPLING, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        if cfg.fsdp and self.world_size > 1:
            # Sharded weights are gathered in every forward: a rank whose rows finished must keep stepping.
            sampling["synced_gpus"] = True
        stop_ids = stop_token_ids(self.model, self.tokenizer)
        # The model's generation_config (a real checkpoint's repetition_penalty, top_k, min_p, ...) must not change
        # what is sampled: the loss scores the completions under the plain (temperature-scaled) softmax.
        sampling = {**NEUTRAL_GENERATION, **sampling}
        was_training = self.model.training
        self.model.eval()
        with bf16_autocast(self.use_bf16, self.device):
            sequences = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=cfg.max_completion_length,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=stop_ids, **sampling,
            )  # fmt: skip
        self.model.train(was_training)
        completion_ids = sequences[:, prompt_ids.shape[1] :]
        is_eos = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
        has_eos = is_eos.any(dim=1)
        length = completion_ids.shape[1]
        first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, length, dtype=torch.long))
        positions = torch.arange(length, device=completion_ids.device)
        completion_mask = positions.unsqueeze(0) <= first_eos.unsqueeze(1)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, ~has_eos

    def decode_completions(
        self, completion_ids: Tensor, completion_mask: Tensor, prompts: Sequence[Prompt] | None = None
    ) -> list[Completion]:
        """Completion texts: tokens up to the first stop token, special tokens removed.

        With ``prompts``, the completion of a conversational prompt (a list of messages) is a list of one message,
        ``[{"role": "assistant", "content": text}]``, as TRL gives it to reward functions; of a string prompt, the
        text.
        """
        rows = [ids[mask].tolist() for ids, mask in zip(completion_ids, completion_mask, strict=True)]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        if prompts is None:
            return texts
        return [[{"role": "assistant", "content": text}] if is_conversational(prompt) else text
                for prompt, text in zip(prompts, texts, strict=True)]  # fmt: skip

    @torch.no_grad()
    def generate_batch(
        self, reward_names: list[str]
    ) -> tuple[list[dict[str, Any]], dict[str, float], list[tuple[str, str, float]]]:
        """One generation batch: sample, score, compute advantages and frozen log-probs, cut the micro-batches.

        This rank generates and keeps only its rows of the global generation batch (``distributed.local_rows``);
        the rewards of all rows are all-gathered, so advantages (group and batch statistics) and the logged
        rollout metrics are those of the global batch.

        Args:
            reward_names: the K reward functions' names (for the metrics).

        Returns:
            This rank's micro-batches (``prompt_ids``/``prompt_mask`` ``[B, Lp]``, ``completion_ids``/
            ``completion_mask`` ``[B, T]``, ``advantages [B]`` float32, ``zero_std [B]`` bool, ``old_logps``/
            ``ref_logps`` ``[B, T]`` float32 or None), the rollout metrics, and this rank's
            ``(prompt, completion, reward)`` samples.
        """
        cfg = self.config
        group = cfg.num_generations
        per_device, steps = cfg.per_device_train_batch_size, cfg.steps_per_generation
        num_prompts = per_device * steps * self.world_size // group
        if cfg.dynamic_sampling:
            everything, rounds = self._dynamic_rollout(num_prompts)
            rollout = select_rows(everything, torch.tensor(self.local_rows))
        else:
            rollout, rounds = self._rollout(self.next_prompt_rows(num_prompts), self.local_rows), 1
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
        adv = group_advantages(all_rewards, cfg)
        mine = torch.tensor(self.local_rows, device=self.device)

        full = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv.advantages[mine],
            "zero_std": adv.zero_std.repeat_interleave(group)[mine],
        }  # fmt: skip
        micro = [{k: v[i : i + per_device] for k, v in full.items()} for i in range(0, len(mine), per_device)]
        for mb in micro:
            mb["old_logps"] = self.logps(self.model, mb) if self.needs_old_logps else None
            mb["ref_logps"] = self.logps(self.ref_model, mb) if self.ref_model is not None else None

        weights = torch.tensor(cfg.reward_weights or [1.0] * num_rewards, dtype=torch.float64, device=self.device)
        total = (all_rewards.double() * weights).nansum(dim=1)  # float64: no overflow for finite float32 rewards
        # A group std beyond float32's range (rewards near +-3.4e38) is inf in float32: log the float64 one.
        stats = adv if bool(torch.isfinite(adv.group_std).all()) else group_advantages(all_rewards.double(), cfg)
        metrics = rollout_metrics(
            total, all_rewards, reward_names, lengths=all_stats[:, num_rewards],
            truncated=all_stats[:, num_rewards + 1].bool(), prompt_lengths=all_stats[:, num_rewards + 2], adv=stats,
            sampling_rounds=rounds if cfg.dynamic_sampling else None,
        )  # fmt: skip
        local_total = total[mine].tolist()
        samples = list(zip(
            map(message_text, rollout["prompts"]), map(message_text, rollout["completions"]), local_total, strict=True
        ))  # fmt: skip
        return micro, metrics, samples

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
        generation = self.generation
        self.generation += 1
        if len(rows) == 0:
            return None
        row_prompts = [prompt_rows[j // group] for j in rows]
        prompts = [row["prompt"] for row in row_prompts]
        seeds = [dist_utils.row_seed(self.config.seed, generation, j) for j in rows]
        prompt_ids, prompt_mask, completion_ids, completion_mask, truncated = self.generate(prompts, 1, row_seeds=seeds)
        completions = self.decode_completions(completion_ids, completion_mask, prompts)

        columns: dict[str, list] = {}
        for key in prompt_rows[0]:
            if key != "prompt":
                columns[key] = [row.get(key) for row in row_prompts]
        columns["completion_truncated"] = truncated.tolist()
        rewards = self.score(prompts, completions, columns)
        return {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "truncated": truncated, "rewards": rewards.to(self.device),
            "prompts": prompts, "completions": completions,
        }  # fmt: skip

    def _gather_rollout(self, local: dict[str, Any] | None) -> dict[str, Any]:
        """Every rank's rows of a round, concatenated in rank order (padded to a common width), on every rank."""
        if self.world_size == 1:
            assert local is not None
            return local
        on_cpu = None if local is None else map_tensors(local, lambda t: t.cpu())
        parts = [part for part in dist_utils.all_gather_objects(on_cpu) if part is not None]
        return map_tensors(concat_rollouts(parts, self.tokenizer.pad_token_id), lambda t: t.to(self.device))

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
            prompt_rows = self.next_prompt_rows(num_prompts - num_kept)
            total = len(prompt_rows) * group
            mine = range(self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size)
            last = self._gather_rollout(self._rollout(prompt_rows, mine))
            rounds += 1
            varied = ~group_advantages(last["rewards"], self.config).zero_std
            kept.append(select_groups(last, varied, group))
            num_kept += int(varied.sum().item())
        if num_kept < num_prompts:
            flat = group_advantages(last["rewards"], self.config).zero_std
            fill = flat & (flat.cumsum(0) <= num_prompts - num_kept)
            kept.append(select_groups(last, fill, group))
        return concat_rollouts(kept, self.tokenizer.pad_token_id), rounds
