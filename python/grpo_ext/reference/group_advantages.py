"""Reference of group_advantages (docs/math.md section 1) in plain PyTorch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..results import GroupAdvantages
from ..validation import reward_weights_tensor, validate_group_advantages_args
from ..validation.options import ZERO_STD_TOL
from ._common import compute_dtype, nan_mean_std


def group_members(batch: int, group_size: int | None, group_ids: Tensor | None, num_groups: int) -> Tensor:
    """The rows of each group, ``[num_groups, max group size]`` int64, in increasing row order, padded with -1.

    Args:
        batch: ``B``.
        group_size: ``G`` when the groups are contiguous runs of ``G`` rows (``group_ids`` None).
        group_ids: ``[B]`` int64 group of each row, in ``[0, num_groups)``; rows of a group need not be adjacent.
        num_groups: the number of groups (some may have no row).
    """
    if group_ids is None:
        assert group_size is not None
        return torch.arange(batch).reshape(num_groups, group_size)
    ids = group_ids.detach().cpu()
    order = torch.argsort(ids, stable=True)  # rows grouped, increasing inside each group
    counts = torch.bincount(ids, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(batch) - starts[ids[order]]  # each row's place inside its group
    members = torch.full((num_groups, int(counts.max()) if batch else 0), -1, dtype=torch.int64)
    members[ids[order], position] = order
    return members


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    group_ids: Tensor | None = None,
    num_groups: int | None = None,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: str = "group",
    baseline: str = "mean",
    multi_objective_aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
    std_ddof: int = 1,
    singleton_groups: str = "zero",
) -> GroupAdvantages:
    """Group-relative advantages (docs/math.md section 1).

    The ``G`` completions of one prompt are contiguous rows, or the rows ``group_ids`` names (groups in any order and
    of any sizes). NaN in ``rewards`` means "this reward function did
    not score this row" (+-inf is treated the same). All statistics are NaN-aware (computed over scored members
    only).

    Args:
        rewards: ``[B]`` or ``[B, K]`` floating tensor (K reward functions), NaN = not scored.
        group_size: ``G >= 1``; ``B`` must be divisible by it. Exactly one of ``group_size`` and ``group_ids``.
        group_ids: ``[B]`` int64, the group of each row, in ``[0, num_groups)``.
        num_groups: with ``group_ids``, the number of groups (default ``max(group_ids) + 1``, a host sync on CUDA;
            required on the meta device).
        reward_weights: ``K`` weights ``w_k`` (sequence or 1-D tensor); default all ones.
        scale_rewards: ``"group"`` (divide by the group's std + eps), ``"batch"`` (divide by the NaN-aware std of
            R over the whole batch + eps; centering stays per group) or ``"none"`` (Dr. GRPO, no division).
        baseline: ``"mean"`` (group mean, GRPO) or ``"leave_one_out"`` (mean of the other scored rows, RLOO).
        multi_objective_aggregation: ``"sum_then_normalize"`` (``R_i = sum_k w_k r[i,k]`` over scored k, NaN if
            none is scored) or ``"normalize_then_sum"`` (GDPO: z-score each function in its group,
            ``R_i = nansum_k w_k z[i,k]``, then z-score R over the batch; ``scale_rewards`` and ``baseline`` are
            ignored).
        eps: added to the std (never inside a sqrt); must be > 0.
        std_ddof: delta degrees of freedom of every std (1 = Bessel, as TRL); a std over fewer than
            ``std_ddof + 1`` scored members is 0.
        singleton_groups: ``"zero"`` (a group of one row has its own mean: A = 0) or ``"verl"`` (mean 0 and std 1,
            so A = R / (1 + eps), R with ``scale_rewards="none"``); sum_then_normalize only (an error with
            normalize_then_sum).

    Returns:
        :class:`GroupAdvantages` with ``advantages [B]``, ``group_mean [B/G]``, ``group_std [B/G]`` in the compute
        dtype (``rewards.dtype`` promoted to at least float32) and ``zero_std [B/G]`` bool (``[num_groups]`` with
        ``group_ids``; a group without rows reports 0, 0, False).

    Raises:
        ValueError: bad ``group_size``, ``B % G != 0``, non-floating ``rewards``, wrong-length ``reward_weights``,
            unknown option strings, ``eps <= 0``, ``std_ddof < 0``, meta ``group_ids`` without ``num_groups``, or
            ``singleton_groups="verl"`` with ``normalize_then_sum``.
    """
    group_size, group_ids, num_groups, eps, std_ddof = validate_group_advantages_args(
        rewards, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof, singleton_groups,
        group_ids, num_groups,
    )  # fmt: skip
    batch = rewards.shape[0]
    members = group_members(batch, group_size, group_ids, num_groups).to(rewards.device)  # [num_groups, N]
    present = members >= 0
    rows = members.clamp(min=0)
    nan = torch.tensor(float("nan"), dtype=compute_dtype(rewards), device=rewards.device)

    def by_group(x: Tensor) -> Tensor:  # [B, ...] -> [num_groups, N, ...], NaN (not scored) where no member
        gathered = x[rows]
        return torch.where(present.reshape(present.shape + (1,) * (x.dim() - 1)), gathered, nan)

    def to_rows(x: Tensor) -> Tensor:  # [num_groups, N] -> [B]
        return torch.zeros(batch, dtype=x.dtype, device=x.device).index_put_((members[present],), x[present])

    # The float64 formulas (docs/math.md: "the advantages are those of the float64 formulas"), whatever the rewards'
    # dtype, so that rewards near float32's largest values (a std beyond its range) still scale; outputs in
    # out_dtype, the rewards' promoted to at least float32
    out_dtype, dtype = compute_dtype(rewards), torch.float64
    r = rewards.detach().to(dtype)
    r = torch.where(torch.isfinite(r), r, torch.full_like(r, float("nan")))  # +-inf is not scored, like NaN
    if r.dim() == 1:
        r = r.unsqueeze(1)  # [B, 1]
    num_rewards = r.shape[1]
    w = reward_weights_tensor(reward_weights, num_rewards, dtype, r.device)  # [K]

    if multi_objective_aggregation == "normalize_then_sum":
        # z-score each reward function inside its group: stats over the G rows, per (group, function).
        r_by_group = by_group(r).transpose(1, 2)  # [B/G, K, G]
        mean_gk, std_gk, _ = nan_mean_std(r_by_group, std_ddof)  # [B/G, K]
        z_by_group = (r_by_group - mean_gk.unsqueeze(-1)) / (std_gk.unsqueeze(-1) + eps)  # NaN where r is NaN
        z = torch.stack([to_rows(z_by_group[:, k]) for k in range(num_rewards)], dim=1)  # [B, K]
        combined = torch.nansum(w * z, dim=1)  # [B]
        # an unscorable row (every k NaN) is NaN, not 0: it stays out of the batch statistics (as in TRL 1.16)
        combined = torch.where(torch.isnan(r).all(dim=1), torch.full_like(combined, float("nan")), combined)
        # then z-score the combined reward over the whole batch
        batch_mean, batch_std, _ = nan_mean_std(combined, std_ddof)  # 0-dim
        advantages = (combined - batch_mean) / (batch_std + eps)
        advantages = torch.where(torch.isnan(combined), torch.zeros_like(advantages), advantages)
    else:
        # sum_then_normalize: R_i = sum over scored k of w_k r[i,k]; NaN iff no k is scored.
        scored = ~torch.isnan(r)
        weighted = torch.where(scored, r, torch.zeros_like(r)) * w
        combined = weighted.sum(dim=1)  # [B]
        combined = torch.where(scored.any(dim=1), combined, torch.full_like(combined, float("nan")))

        grouped = by_group(combined)  # [B/G, G]
        g_mean, g_std, g_count = nan_mean_std(grouped, std_ddof)  # [B/G]
        row_scored = ~torch.isnan(grouped)

        # baseline b_i
        if baseline == "mean":
            base = g_mean.unsqueeze(1).expand_as(grouped)
            has_baseline = row_scored
        else:  # leave_one_out: mean of the *other* scored rows of the group
            grouped_zero = torch.where(row_scored, grouped, torch.zeros_like(grouped))
            others_sum = grouped_zero.sum(dim=1, keepdim=True) - grouped_zero
            others_count = g_count.unsqueeze(1) - row_scored.to(g_count.dtype)
            base = others_sum / others_count.clamp(min=1).to(dtype)
            has_baseline = row_scored & (others_count >= 1)

        # scale sigma
        centered = grouped - base
        if scale_rewards == "group":
            advantages = centered / (g_std.unsqueeze(1) + eps)
        elif scale_rewards == "batch":
            _, batch_std, _ = nan_mean_std(combined, std_ddof)
            advantages = centered / (batch_std + eps)
        else:  # "none"
            advantages = centered
        # a NaN row, or a leave-one-out row with no other scored member, gets A = 0
        advantages = torch.where(has_baseline, advantages, torch.zeros_like(advantages))
        if singleton_groups == "verl":  # verl: a group of one row has mean 0 and std 1
            reward = torch.where(row_scored, grouped, torch.zeros_like(grouped))
            if scale_rewards == "group":
                verl_advantages = reward / (1 + eps)
            elif scale_rewards == "batch":
                verl_advantages = reward / (nan_mean_std(combined, std_ddof)[1] + eps)
            else:
                verl_advantages = reward
            singleton = (present.sum(dim=1, keepdim=True) == 1) & present
            advantages = torch.where(singleton, verl_advantages, advantages)
        advantages = to_rows(advantages)

    # group statistics of the combined reward (every mode)
    group_mean, group_std, group_count = nan_mean_std(by_group(combined), std_ddof)
    zero_std = (group_count >= 2) & (group_std <= ZERO_STD_TOL)
    return GroupAdvantages(advantages=advantages.to(out_dtype), group_mean=group_mean.to(out_dtype),
                           group_std=group_std.to(out_dtype), zero_std=zero_std)  # fmt: skip
