"""Held-out evaluation of GRPOTrainer: greedy completions of an eval set, scored by the training rewards.

What a user of a real model wants to see while it trains is whether it answers prompts it never trained on. The
sampled training reward mixes that with the sampling temperature and with prompts seen before; the eval reward is the
mean weighted reward of one greedy completion per held-out prompt (with a 0/1 reward: the accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import distributed as dist_utils
from .rollout import RolloutGenerator

EVAL_REWARD = "eval/reward"


def evaluate_greedy(
    rollouts: RolloutGenerator,
    rows: Sequence[dict[str, Any]],
    score: Callable[[list[Any], list[Any], dict[str, list]], Tensor],
    reward_names: list[str],
    reward_weights: list[float] | None,
    batch_size: int,
) -> dict[str, float]:
    """Greedy completions of ``rows`` (one per prompt) scored by every reward function, over all ranks.

    Rank ``r`` of ``W`` completes rows ``r, r + W, ...``; every rank makes the same number of ``generate`` calls of
    the same sizes (a short rank repeats row 0 and drops it), since under FSDP each forward gathers the weights on
    all ranks. The sums are all-reduced, so every rank returns the same metrics.

    Args:
        rollouts: the trainer's generator (its ``generate(..., greedy=True)``: the tokenizer's chat template for
            message prompts, ``max_completion_length`` new tokens, the model's stop tokens).
        rows: the eval set: dicts with a ``prompt`` and the columns the rewards take.
        score: ``score(prompts, completions, columns) -> rewards [N, K]`` float32 (NaN: not scored).
        reward_names: the K reward functions' names.
        reward_weights: ``[K]`` weights of the combined reward (None: all 1), as in training.
        batch_size: prompts per ``generate`` call.

    Returns:
        ``eval/reward`` (mean over the rows of the weighted sum of their scored rewards, as the training ``reward``),
        ``eval/rewards/<name>/mean`` (over the rows that function scored; NaN when it scored none) and
        ``eval/completions/mean_length`` (tokens, the stop token included).
    """
    world, rank = dist_utils.world_size(), dist_utils.rank()
    device = rollouts.device
    per_rank = math.ceil(len(rows) / world)
    mine = list(range(rank, len(rows), world))
    num_valid = len(mine)
    mine += [0] * (per_rank - num_valid)
    num_rewards = len(reward_names)
    weights = torch.tensor(reward_weights or [1.0] * num_rewards, dtype=torch.float32)
    # [total, rows, lengths, per-function sums (K), per-function scored counts (K)], float64 so sums are exact
    sums = torch.zeros(3 + 2 * num_rewards, dtype=torch.float64)
    for start in range(0, per_rank, batch_size):
        chunk = [rows[i] for i in mine[start : start + batch_size]]
        prompts = [row["prompt"] for row in chunk]
        _, _, completion_ids, completion_mask, truncated = rollouts.generate(prompts, 1, greedy=True)
        completions = rollouts.decode_completions(completion_ids, completion_mask, prompts)
        columns = {key: [row.get(key) for row in chunk] for key in rows[0] if key != "prompt"}
        columns["completion_truncated"] = truncated.tolist()
        rewards = score(prompts, completions, columns).double()  # [n, K] on the CPU
        valid = torch.arange(start, start + len(chunk)) < num_valid
        rewards, lengths = rewards[valid], completion_mask.sum(dim=1).cpu()[valid]
        scored = ~rewards.isnan()
        sums[0] += (rewards * weights.double()).nansum()
        sums[1] += valid.sum()
        sums[2] += lengths.sum()
        sums[3 : 3 + num_rewards] += rewards.nansum(dim=0)
        sums[3 + num_rewards :] += scored.sum(dim=0)
    sums = dist_utils.all_reduce_sum(sums.to(device)).cpu().tolist()
    count = max(sums[1], 1.0)
    metrics = {EVAL_REWARD: sums[0] / count, "eval/completions/mean_length": sums[2] / count}
    for k, name in enumerate(reward_names):
        scored_count = sums[3 + num_rewards + k]
        metrics[f"eval/rewards/{name}/mean"] = sums[3 + k] / scored_count if scored_count else math.nan
    return metrics
