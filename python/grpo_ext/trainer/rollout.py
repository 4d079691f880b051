"""Rollouts of GRPOTrainer: prompt order, ``model.generate`` with per-row seeds, scoring, DAPO dynamic sampling.

Also the helpers that select, pad and concatenate rollout batches (dicts of ``[N, ...]`` tensors and ``N``-lists).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

import grpo_ext

from . import distributed as dist_utils
from .config import GRPOConfig
from .metrics import rollout_metrics

# A dataset row's prompt: a string, or a list of messages ``[{"role": "user", "content": ...}, ...]``.
Prompt = str | list[dict[str, Any]]
# What reward functions get for a completion: its text, or ``[{"role": "assistant", "content": text}]``.
Completion = str | list[dict[str, Any]]
# score(prompts, completions, columns) -> rewards [N, K] float32 (NaN: not scored), K reward functions.
ScoreFunc = Callable[[list[Prompt], list[Completion], dict[str, list]], Tensor]

# Generation options set to their no-op values in every ``generate`` call, so that a checkpoint's
# generation_config (read by ``generate`` for every option not given) cannot add a repetition penalty, a top-k or
# min-p cut-off, or a minimum length to the sampling: the completions are drawn from softmax(logits / temperature)
# with the GRPOConfig's top_k/top_p only, the distribution the loss assumes. (Options with no no-op value, such as
# bad_words_ids or suppress_tokens, still come from the model's generation_config.)
NEUTRAL_GENERATION: dict[str, Any] = {
    "num_beams": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
}  # fmt: skip
# The same for the warpers, which only act when generate samples (do_sample=True).
NEUTRAL_SAMPLING: dict[str, Any] = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt (or completion) is a list of messages (dicts with a ``role``), as TRL's
    ``is_conversational`` decides it; a string is not."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def message_text(value: Any) -> str:
    """The text of a prompt or completion: a string as it is, a list of messages as its last message's content."""
    if is_conversational(value):
        content = value[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return value if isinstance(value, str) else str(value)


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids, as TRL's GRPOTrainer makes them.

    A list of messages goes through the tokenizer's chat template (``apply_chat_template``, which adds what the
    template holds, e.g. a BOS, and no other special tokens), with the generation prompt (the assistant's header)
    when the last message is a user's (or a tool's), continuing the last message when it is the assistant's. A
    string is tokenized as it is, with the tokenizer's special tokens (a BOS where the tokenizer adds one) and no
    chat template, even when the tokenizer has one.

    Raises:
        ValueError: a list of messages with a tokenizer that has no chat template, or a prompt of another type.
    """
    if is_conversational(prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a prompt is a list of messages but the tokenizer has no chat_template: give a "
                             "tokenizer with one, or string prompts")  # fmt: skip
        continuing = prompt[-1].get("role") == "assistant"
        ids = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=not continuing, continue_final_message=continuing,
            return_dict=False,
        )  # fmt: skip
        return [int(i) for i in ids]
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt must be a string or a list of messages ({{'role': ..., 'content': ...}}), got "
                         f"{prompt!r:.80} ({type(prompt).__name__})")  # fmt: skip
    return list(tokenizer(prompt)["input_ids"])


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, then the model's ``generation_config.eos_token_id``
    (an int or a list: a chat model's end-of-turn token, e.g. Llama 3's ``<|eot_id|>``, may differ from the
    tokenizer's EOS)."""
    ids = [int(tokenizer.eos_token_id)]
    config = getattr(model, "generation_config", None)
    model_eos = getattr(config, "eos_token_id", None)
    if model_eos is not None:
        for token in [model_eos] if isinstance(model_eos, int) else list(model_eos):
            if int(token) not in ids:
                ids.append(int(token))
    return ids


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


def bf16_autocast(enabled: bool, device: torch.device) -> AbstractContextManager:
    """bfloat16 autocast when ``enabled`` and ``device`` is CUDA, else a context that does nothing."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def group_advantages(rewards: Tensor, config: GRPOConfig) -> grpo_ext.GroupAdvantages:
    """:func:`grpo_ext.group_advantages` of ``rewards [N, K]`` float32 with the config's group size and weights."""
    return grpo_ext.group_advantages(
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
        state is saved with the RNG states)."""
        return {"prompt_order": self.prompt_order, "prompt_pos": self.prompt_pos, "generation": self.generation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``generation`` 0 when absent)."""
        self.prompt_order = state["prompt_order"]
        self.prompt_pos = state["prompt_pos"]
        self.generation = state.get("generation", 0)

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
            rollout = _select_rows(everything, torch.tensor(self.local_rows))
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

        weights = torch.tensor(cfg.reward_weights or [1.0] * num_rewards, device=self.device)
        total = (all_rewards * weights).nansum(dim=1)
        metrics = rollout_metrics(
            total, all_rewards, reward_names, lengths=all_stats[:, num_rewards],
            truncated=all_stats[:, num_rewards + 1].bool(), prompt_lengths=all_stats[:, num_rewards + 2], adv=adv,
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
            prompt_rows = self.next_prompt_rows(num_prompts - num_kept)
            total = len(prompt_rows) * group
            mine = range(self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size)
            last = self._gather_rollout(self._rollout(prompt_rows, mine))
            rounds += 1
            varied = ~group_advantages(last["rewards"], self.config).zero_std
            kept.append(_select_groups(last, varied, group))
            num_kept += int(varied.sum().item())
        if num_kept < num_prompts:
            flat = group_advantages(last["rewards"], self.config).zero_std
            fill = flat & (flat.cumsum(0) <= num_prompts - num_kept)
            kept.append(_select_groups(last, fill, group))
        return _concat_rollouts(kept, self.tokenizer.pad_token_id), rounds


def _map_tensors(rows: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """``rows`` with ``fn`` applied to its tensor entries (other entries as they are)."""
    return {key: fn(value) if isinstance(value, Tensor) else value for key, value in rows.items()}


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
        """``t [N, w]`` padded to ``[N, width]`` on the left or the right with ``value`` (None: the pad token)."""
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
