"""grpo_ext.reference: plain-PyTorch reference of ../spec, used as the test oracle and as a CPU/GPU fallback.

Every function here is a direct, readable transcription of ``spec/grpo-math.md`` (sections 1 and 3-8).
Kernels (CPU or CUDA) must match these values *and* their autograd gradients, so the code deliberately uses
the exact torch primitives the spec names (``torch.minimum``, ``torch.clamp``, ``torch.exp``,
``torch.sigmoid``): their autograd conventions at ties and bounds are part of the contract
(``torch.minimum`` splits the gradient half/half at a tie; ``torch.clamp`` passes the gradient at its bounds).

Arithmetic runs in the input's dtype promoted to at least float32
(``torch.promote_types(x.dtype, torch.float32)``): float64 in gives float64 out, bf16/fp16/fp32 in gives float32.

The small ``_check_*`` helpers at the top are the shared argument validation; the kernel wrappers import them
so that every implementation raises the same ``ValueError`` messages.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BASELINES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS",
    "GRPOLossOutput",
    "GroupAdvantages",
    "SelectiveLogSoftmax",
    "group_advantages",
    "grpo_loss",
    "process_advantages",
    "selective_log_softmax",
]

# ----------------------------------------------------------------------------------------------------------------
# Allowed option values
# ----------------------------------------------------------------------------------------------------------------

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
CLIP_FAMILY_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
BASELINES: tuple[str, ...] = ("mean", "leave_one_out")
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")

#: Default absolute ratio cap of ``loss_type="cispo"`` when ``epsilon_high`` is left unset (spec section 3).
CISPO_DEFAULT_CAP: float = 5.0

#: A group whose reward std is at most this (and that has >= 2 scored members) is a zero-std group (section 1).
ZERO_STD_TOL: float = 1e-8


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers (shared with the kernel wrappers)
# ----------------------------------------------------------------------------------------------------------------


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Raises ValueError unless ``value`` is one of ``allowed``; the message lists the allowed values."""
    if not isinstance(value, str) or value not in allowed:
        allowed_list = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {allowed_list}; got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> int:
    """Returns ``value`` as a Python int, raising ValueError unless it is an integer >= ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        as_int = operator.index(value)  # accepts int, numpy ints, 0-dim integer tensors
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if as_int < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {as_int}")
    return as_int


def _check_real_number(name: str, value: object) -> float:
    """Returns ``value`` as a Python float, raising ValueError unless it is a real (non-bool) Python number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number > 0 (NaN is rejected)."""
    x = _check_real_number(name, value)
    if not x > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def _check_non_negative(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number >= 0 (NaN is rejected)."""
    x = _check_real_number(name, value)
    if not x >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def _check_tensor(name: str, value: object) -> Tensor:
    """Raises ValueError unless ``value`` is a torch.Tensor."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_floating(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` has a floating-point dtype."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_integer(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` has an integer (non-bool) dtype."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int64), got {t.dtype}")


def _check_shape(name: str, t: Tensor, allowed: Sequence[tuple[int, ...]], described: str) -> None:
    """Raises ValueError unless ``tuple(t.shape)`` is one of ``allowed``.

    Args:
        name: the argument name used in the message.
        t: the tensor to check.
        allowed: the accepted concrete shapes.
        described: the accepted shapes in symbols for the message, e.g. ``"[B,T]=(4, 7)"``.
    """
    if tuple(t.shape) not in [tuple(s) for s in allowed]:
        raise ValueError(f"{name} must have shape {described}, got {tuple(t.shape)}")


def _check_same_device(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raises ValueError if any tensor in ``others`` (None entries are skipped) is not on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on device {t.device} but {reference_name} is on device {reference.device}; "
                "all tensors must be on the same device"
            )


def _compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype arithmetic runs in: ``t``'s dtype promoted to at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# NaN-aware statistics
# ----------------------------------------------------------------------------------------------------------------


def _nan_mean_std(x: Tensor, std_ddof: int) -> tuple[Tensor, Tensor, Tensor]:
    """NaN-aware mean and std over the last dimension; NaN entries are "not scored".

    Args:
        x: ``[..., N]`` floating tensor, NaN marking entries to ignore.
        std_ddof: delta degrees of freedom of the std (1 = Bessel).

    Returns:
        ``(mean, std, count)``, each ``[...]``: ``mean`` is the mean of the scored entries (0 when none is scored),
        ``std`` is ``sqrt(sum (x - mean)^2 / (count - std_ddof))`` over the scored entries, and 0 (not NaN) when
        ``count < std_ddof + 1``; ``count`` (int64) is the number of scored entries.
    """
    scored = ~torch.isnan(x)
    count = scored.sum(dim=-1)
    values = torch.where(scored, x, torch.zeros_like(x))
    mean = values.sum(dim=-1) / count.clamp(min=1).to(x.dtype)
    squared_dev = torch.where(scored, (values - mean.unsqueeze(-1)) ** 2, torch.zeros_like(x))
    variance = squared_dev.sum(dim=-1) / (count - std_ddof).clamp(min=1).to(x.dtype)
    std = torch.where(count >= std_ddof + 1, variance.sqrt(), torch.zeros_like(variance))
    return mean, std, count


# ----------------------------------------------------------------------------------------------------------------
# Section 1: group advantages
# ----------------------------------------------------------------------------------------------------------------


class GroupAdvantages(NamedTuple):
    """Output of :func:`group_advantages`.

    Attributes:
        advantages: ``[B]`` per-completion advantage, never NaN.
        group_mean: ``[B/G]`` NaN-aware mean of the combined reward R over each group (0 for a group with no
            scored member).
        group_std: ``[B/G]`` NaN-aware std (``std_ddof``) of R over each group, whatever ``scale_rewards`` is;
            0 for a group with fewer than ``std_ddof + 1`` scored members.
        zero_std: ``[B/G]`` bool, true iff the group has at least 2 scored members and ``group_std <= 1e-8``.
    """

    advantages: Tensor
    group_mean: Tensor
    group_std: Tensor
    zero_std: Tensor


def _reward_weights_tensor(
    reward_weights: Sequence[float] | Tensor | None, num_rewards: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Returns the ``[K]`` reward weights in ``dtype`` on ``device`` (ones when None), validating the length."""
    if reward_weights is None:
        return torch.ones(num_rewards, dtype=dtype, device=device)
    try:
        w = torch.as_tensor(reward_weights, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"reward_weights must be a sequence of numbers or a 1-D tensor: {err}") from None
    if w.dim() != 1:
        raise ValueError(f"reward_weights must be 1-D with K={num_rewards} entries, got shape {tuple(w.shape)}")
    if w.shape[0] != num_rewards:
        raise ValueError(f"reward_weights must have K={num_rewards} entries, got {w.shape[0]}")
    return w


def validate_group_advantages_args(
    rewards: Tensor,
    group_size: int,
    scale_rewards: str,
    baseline: str,
    multi_objective_aggregation: str,
    eps: float,
    std_ddof: int,
) -> tuple[int, float, int]:
    """Checks group_advantages' arguments (shared with the native op's wrapper); returns group_size, eps, std_ddof.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    _check_tensor("rewards", rewards)
    _check_floating("rewards", rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape [B] or [B,K], got {tuple(rewards.shape)}")
    group_size = _check_int("group_size", group_size, 1)
    batch = rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(f"rewards.shape[0]={batch} is not divisible by group_size={group_size}")
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _check_choice("baseline", baseline, BASELINES)
    _check_choice("multi_objective_aggregation", multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    eps = _check_positive("eps", eps)
    std_ddof = _check_int("std_ddof", std_ddof, 0)
    return group_size, eps, std_ddof


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    reward_weights: Sequence[float] | Tensor | None = None,
    scale_rewards: str = "group",
    baseline: str = "mean",
    multi_objective_aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
    std_ddof: int = 1,
) -> GroupAdvantages:
    """Group-relative advantages (spec section 1).

    The ``G`` completions of one prompt are contiguous rows. NaN in ``rewards`` means "this reward function did
    not score this row". All statistics are NaN-aware (computed over scored members only).

    Args:
        rewards: ``[B]`` or ``[B, K]`` floating tensor (K reward functions), NaN = not scored.
        group_size: ``G >= 1``; ``B`` must be divisible by it.
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

    Returns:
        :class:`GroupAdvantages` with ``advantages [B]``, ``group_mean [B/G]``, ``group_std [B/G]`` in the compute
        dtype (``rewards.dtype`` promoted to at least float32) and ``zero_std [B/G]`` bool.

    Raises:
        ValueError: bad ``group_size``, ``B % G != 0``, non-floating ``rewards``, wrong-length ``reward_weights``,
            unknown option strings, ``eps <= 0`` or ``std_ddof < 0``.
    """
    group_size, eps, std_ddof = validate_group_advantages_args(
        rewards, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof
    )
    batch = rewards.shape[0]

    dtype = _compute_dtype(rewards)
    r = rewards.detach().to(dtype)
    if r.dim() == 1:
        r = r.unsqueeze(1)  # [B, 1]
    num_rewards = r.shape[1]
    num_groups = batch // group_size
    w = _reward_weights_tensor(reward_weights, num_rewards, dtype, r.device)  # [K]

    if multi_objective_aggregation == "normalize_then_sum":
        # z-score each reward function inside its group: stats over the G rows, per (group, function).
        r_by_group = r.reshape(num_groups, group_size, num_rewards).transpose(1, 2)  # [B/G, K, G]
        mean_gk, std_gk, _ = _nan_mean_std(r_by_group, std_ddof)  # [B/G, K]
        z = (r_by_group - mean_gk.unsqueeze(-1)) / (std_gk.unsqueeze(-1) + eps)  # NaN where r is NaN
        z = z.transpose(1, 2).reshape(batch, num_rewards)  # [B, K]
        combined = torch.nansum(w * z, dim=1)  # [B]; a row with every k NaN gets 0 (torch.nansum, as TRL)
        # then z-score the combined reward over the whole batch
        batch_mean, batch_std, _ = _nan_mean_std(combined, std_ddof)  # 0-dim
        advantages = (combined - batch_mean) / (batch_std + eps)
        advantages = torch.where(torch.isnan(combined), torch.zeros_like(advantages), advantages)
    else:
        # sum_then_normalize: R_i = sum over scored k of w_k r[i,k]; NaN iff no k is scored.
        scored = ~torch.isnan(r)
        weighted = torch.where(scored, r, torch.zeros_like(r)) * w
        combined = weighted.sum(dim=1)  # [B]
        combined = torch.where(scored.any(dim=1), combined, torch.full_like(combined, float("nan")))

        grouped = combined.reshape(num_groups, group_size)  # [B/G, G]
        g_mean, g_std, g_count = _nan_mean_std(grouped, std_ddof)  # [B/G]
        row_scored = ~torch.isnan(grouped)

        # baseline b_i
        if baseline == "mean":
            base = g_mean.unsqueeze(1).expand(num_groups, group_size)
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
            _, batch_std, _ = _nan_mean_std(combined, std_ddof)
            advantages = centered / (batch_std + eps)
        else:  # "none"
            advantages = centered
        # a NaN row, or a leave-one-out row with no other scored member, gets A = 0
        advantages = torch.where(has_baseline, advantages, torch.zeros_like(advantages)).reshape(batch)

    # group statistics of the combined reward (every mode)
    group_mean, group_std, group_count = _nan_mean_std(combined.reshape(num_groups, group_size), std_ddof)
    zero_std = (group_count >= 2) & (group_std <= ZERO_STD_TOL)
    return GroupAdvantages(advantages=advantages, group_mean=group_mean, group_std=group_std, zero_std=zero_std)


# ----------------------------------------------------------------------------------------------------------------
# Section 1 (process supervision): per-token advantages from per-step rewards
# ----------------------------------------------------------------------------------------------------------------


def validate_process_advantages_args(
    step_rewards: Tensor, step_end: Tensor, group_size: int, seq_len: int, eps: float, std_ddof: int
) -> tuple[int, int, float, int]:
    """Checks process_advantages' arguments (shared with the native op's wrapper); returns the normalized numbers.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    _check_tensor("step_rewards", step_rewards)
    _check_tensor("step_end", step_end)
    _check_floating("step_rewards", step_rewards)
    _check_integer("step_end", step_end)
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must have shape [B,S], got {tuple(step_rewards.shape)}")
    _check_shape("step_end", step_end, [tuple(step_rewards.shape)], f"[B,S]={tuple(step_rewards.shape)}")
    _check_same_device("step_rewards", step_rewards, step_end=step_end)
    group_size = _check_int("group_size", group_size, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    eps = _check_positive("eps", eps)
    std_ddof = _check_int("std_ddof", std_ddof, 0)
    batch = step_rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(f"step_rewards.shape[0]={batch} is not divisible by group_size={group_size}")
    return group_size, seq_len, eps, std_ddof


def process_advantages(
    step_rewards: Tensor,
    step_end: Tensor,
    group_size: int,
    seq_len: int,
    *,
    eps: float = 1e-4,
    std_ddof: int = 1,
) -> Tensor:
    """Process-supervision advantages (DeepSeekMath section 4.1.3; spec section 1).

    A step ``(i, j)`` is valid iff ``step_rewards[i,j]`` is not NaN and ``step_end[i,j] >= 0``. All valid steps of
    all rows of a group are normalized together: ``rt = (r - mean_group) / (std_group + eps)`` (std with
    ``std_ddof``, 0 when fewer than ``std_ddof + 1`` valid steps); invalid steps get ``rt = 0``. The token
    advantage is ``A[i,t] = sum over valid j with step_end[i,j] >= t of rt[i,j]``, so tokens after the last step
    get 0.

    Args:
        step_rewards: ``[B, S]`` floating tensor, NaN-padded.
        step_end: ``[B, S]`` integer (int64) tensor: index of the last token of step j of row i, -1 for padding.
        group_size: ``G >= 1``; ``B`` must be divisible by it.
        seq_len: ``T >= 1``, the number of token positions of the output.
        eps: added to the group std; must be > 0.
        std_ddof: delta degrees of freedom of the std (1 = Bessel).

    Returns:
        ``[B, seq_len]`` advantages in ``step_rewards.dtype`` promoted to at least float32 (float32, or float64
        for float64 input); never NaN.

    Raises:
        ValueError: shape/dtype/device mismatches, bad ``group_size``/``seq_len``/``eps``/``std_ddof``.
    """
    group_size, seq_len, eps, std_ddof = validate_process_advantages_args(
        step_rewards, step_end, group_size, seq_len, eps, std_ddof
    )
    batch, num_steps = step_rewards.shape
    num_groups = batch // group_size

    dtype = _compute_dtype(step_rewards)
    r = step_rewards.detach().to(dtype)
    valid = ~torch.isnan(r) & (step_end >= 0)  # [B, S]
    r_valid = torch.where(valid, r, torch.full_like(r, float("nan")))  # NaN marks "not a valid step"

    # group statistics over every valid step of every row of the group
    mean, std, _ = _nan_mean_std(r_valid.reshape(num_groups, group_size * num_steps), std_ddof)  # [B/G]
    mean_row = mean.repeat_interleave(group_size).unsqueeze(1)  # [B, 1]
    std_row = std.repeat_interleave(group_size).unsqueeze(1)  # [B, 1]
    rt = torch.where(valid, (r_valid - mean_row) / (std_row + eps), torch.zeros_like(r))  # [B, S]

    # A[i,t] = sum_j rt[i,j] * [step_end[i,j] >= t]
    positions = torch.arange(seq_len, device=step_rewards.device)  # [T]
    covers = step_end.unsqueeze(2) >= positions.view(1, 1, seq_len)  # [B, S, T]
    return (rt.unsqueeze(2) * covers.to(dtype)).sum(dim=1)  # [B, T]


# ----------------------------------------------------------------------------------------------------------------
# Sections 3-7: the GRPO-family loss
# ----------------------------------------------------------------------------------------------------------------


class GRPOLossOutput(NamedTuple):
    """Output of :func:`grpo_loss`.

    Attributes:
        loss: 0-dim loss (already multiplied by ``loss_scale``), carrying the gradient w.r.t. ``logps``.
        metrics: detached 0-dim tensors in the compute dtype: ``"kl"`` (only when ``beta != 0``), and
            ``"clip_ratio/low_mean"``, ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"`` (every loss type but
            cispo) or ``"cispo_clip_ratio"`` (cispo only).
    """

    loss: Tensor
    metrics: dict[str, Tensor]


def _check_per_row(name: str, t: Tensor, batch: int, length: int) -> None:
    """Raises ValueError unless ``t`` is a floating ``[B]``, ``[B,1]`` or ``[B,T]`` tensor."""
    _check_floating(name, t)
    _check_shape(name, t, [(batch,), (batch, 1), (batch, length)], f"[B]=({batch},), [B,1] or [B,T]={(batch, length)}")


def _per_row(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Detached ``[B]``/``[B,1]``/``[B,T]`` tensor as ``[B,1]`` or ``[B,T]`` in ``dtype`` (for broadcasting)."""
    t = t.detach().to(dtype)
    return t.unsqueeze(1) if t.dim() == 1 else t


def validate_grpo_loss_args(
    logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    is_weights: Tensor | None,
    sample_mask: Tensor | None,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    delta: float | None,
    beta: float,
    kl_estimator: str,
    kl_clamp: float | None,
    importance_sampling_level: str,
    max_completion_length: int | None,
    num_items_in_batch: int | float | Tensor | None,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    loss_scale: float | Tensor,
) -> tuple:
    """Checks grpo_loss' arguments (shared with the native op's wrapper) without syncing the host.

    Returns:
        The normalized ``(epsilon, epsilon_high, delta, beta, kl_clamp, sapo_temperature_pos,
        sapo_temperature_neg, loss_scale, max_completion_length)``, defaults resolved (``epsilon_high``: ``epsilon``,
        or 5.0 for cispo; ``max_completion_length``: ``T``).

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    epsilon = _check_positive("epsilon", epsilon)
    if epsilon_high is None:
        epsilon_high = CISPO_DEFAULT_CAP if loss_type == "cispo" else epsilon
    epsilon_high = _check_positive("epsilon_high", epsilon_high)
    if delta is not None:
        delta = _check_real_number("delta", delta)
        if not delta > 1:
            raise ValueError(f"delta must exceed 1 (it caps the ratio from above, and rho = 1 on-policy), got {delta}")
    beta = _check_non_negative("beta", beta)
    if kl_clamp is not None:
        kl_clamp = _check_positive("kl_clamp", kl_clamp)
    sapo_temperature_pos = _check_positive("sapo_temperature_pos", sapo_temperature_pos)
    sapo_temperature_neg = _check_positive("sapo_temperature_neg", sapo_temperature_neg)
    if isinstance(loss_scale, Tensor):
        if loss_scale.dim() != 0:
            shape = tuple(loss_scale.shape)
            raise ValueError(f"loss_scale must be a Python number or a 0-dim tensor, got shape {shape}")
    else:
        loss_scale = _check_real_number("loss_scale", loss_scale)

    _check_tensor("logps", logps)
    _check_floating("logps", logps)
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape [B,T], got {tuple(logps.shape)}")
    batch, length = logps.shape
    if batch == 0:
        raise ValueError("logps has an empty batch (B == 0); at least one completion is required")
    if length == 0:
        raise ValueError("logps has no token positions (T == 0); at least one position is required")
    bt = f"[B,T]={(batch, length)}"

    _check_tensor("advantages", advantages)
    _check_per_row("advantages", advantages, batch, length)
    _check_tensor("completion_mask", completion_mask)
    _check_shape("completion_mask", completion_mask, [(batch, length)], bt)
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None:
            _check_tensor(name, t)
            _check_floating(name, t)
            _check_shape(name, t, [(batch, length)], bt)
    if is_weights is not None:
        _check_tensor("is_weights", is_weights)
        _check_per_row("is_weights", is_weights, batch, length)
    if sample_mask is not None:
        _check_tensor("sample_mask", sample_mask)
        _check_shape("sample_mask", sample_mask, [(batch,)], f"[B]=({batch},)")
    _check_same_device(
        "logps",
        logps,
        advantages=advantages,
        completion_mask=completion_mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        is_weights=is_weights,
        sample_mask=sample_mask,
    )
    if beta != 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    if max_completion_length is None:
        max_completion_length = length
    max_completion_length = _check_int("max_completion_length", max_completion_length, 1)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            if num_items_in_batch.dim() != 0:
                raise ValueError(
                    f"num_items_in_batch must be a Python number or a 0-dim tensor, "
                    f"got a tensor of shape {tuple(num_items_in_batch.shape)}"
                )
            # its value is not checked: that would sync the host with the device
        else:
            _check_positive("num_items_in_batch", num_items_in_batch)
    return (
        epsilon,
        epsilon_high,
        delta,
        beta,
        kl_clamp,
        sapo_temperature_pos,
        sapo_temperature_neg,
        loss_scale,
        max_completion_length,
    )


def grpo_loss(
    logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    is_weights: Tensor | None = None,
    sample_mask: Tensor | None = None,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    loss_scale: float | Tensor = 1.0,
) -> GRPOLossOutput:
    """GRPO-family policy loss with optional KL penalty (spec sections 3-7).

    Steps: ``m_eff = completion_mask * sample_mask[:, None]``; positions with ``m_eff == 0`` are replaced by 0 in
    ``l``, ``l_old``, ``l_ref`` (and in per-token advantages / IS weights) before any arithmetic, so garbage there
    (even NaN or -inf) never reaches the loss or the gradient. Then ``d = l - l_old``; ``rho = exp(d)`` (token level)
    or ``rho[i,t] = exp(sum_t m_eff*d / max(n_i, 1))`` (sequence level, GSPO); the per-token term ``L`` of
    ``loss_type`` (section 3) is multiplied by ``is_weights``; ``P = L + beta * KL`` (section 4); ``P`` is
    aggregated with ``m_eff`` as in section 5 and multiplied by ``loss_scale``.

    Args:
        logps: ``[B, T]`` floating current-policy log-probs of the sampled tokens; the only input with a gradient.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]`` floating (detached).
        completion_mask: ``[B, T]`` bool/int/float, used as a float weight (bool -> 0/1).
        old_logps: ``[B, T]`` floating old-policy log-probs (detached); None means ``l_old = l.detach()``.
        ref_logps: ``[B, T]`` floating reference log-probs (detached); required when ``beta != 0``.
        is_weights: ``[B, T]``, ``[B, 1]`` or ``[B]`` floating importance-sampling weights (detached); multiply L only.
        sample_mask: ``[B]`` bool/int/float row mask, multiplied into the completion mask before anything else.
        loss_type: one of ``LOSS_TYPES``: grpo, bnpo, dr_grpo, dapo, luspo (clip family), cispo, sapo.
        epsilon: lower clip ``1 - epsilon`` (clip family); > 0.
        epsilon_high: upper clip ``1 + epsilon_high`` (clip family, default ``epsilon``); for cispo the absolute
            ratio cap (default 5.0); > 0.
        delta: optional upper cap of the unclipped ratio (two-sided clipping, INTELLECT-2); must exceed 1.
        beta: KL coefficient, >= 0; the KL term is computed only when ``beta != 0``.
        kl_estimator: ``"k3"`` (``exp(r) - r - 1``), ``"k1"`` (``-r``) or ``"k2"`` (``r^2 / 2``), ``r = l_ref - l``.
        kl_clamp: optional > 0 bound: ``r`` is clamped to ``[-kl_clamp, kl_clamp]``.
        use_bias_correction_kl: multiply KL by ``rho`` (with its gradient), DeepSeek-V3.2.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        max_completion_length: denominator length of ``dr_grpo`` (default ``T``); >= 1.
        num_items_in_batch: denominator of ``dapo``/``cispo`` (Python number > 0 or 0-dim tensor); default
            ``max(sum m_eff, 1)``.
        sapo_temperature_pos: SAPO temperature where ``A > 0``; > 0.
        sapo_temperature_neg: SAPO temperature where ``A <= 0``; > 0.
        loss_scale: Python number or 0-dim tensor multiplying the loss (and therefore the gradient).

    Returns:
        :class:`GRPOLossOutput`: 0-dim ``loss`` and a dict of detached 0-dim metrics, all in the compute dtype
        (``logps.dtype`` promoted to at least float32).

    Raises:
        ValueError: unknown option strings, out-of-range numbers, wrong shapes, non-floating tensors, tensors on
            different devices, an empty batch, or ``beta != 0`` without ``ref_logps``.
    """
    (epsilon, epsilon_high, delta, beta, kl_clamp, sapo_temperature_pos, sapo_temperature_neg, loss_scale,
     max_completion_length) = validate_grpo_loss_args(
        logps, advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask, loss_type, epsilon,
        epsilon_high, delta, beta, kl_estimator, kl_clamp, importance_sampling_level, max_completion_length,
        num_items_in_batch, sapo_temperature_pos, sapo_temperature_neg, loss_scale,
    )  # fmt: skip
    batch, length = logps.shape

    dtype = _compute_dtype(logps)

    # ------------------------------------------------------------------ masks and masked inputs
    m = completion_mask.detach().to(dtype)
    if sample_mask is not None:
        m = m * sample_mask.detach().to(dtype).unsqueeze(1)  # m_eff: [B, T]
    keep = m != 0  # [B, T] bool
    zero = torch.zeros((), dtype=dtype, device=logps.device)

    l = torch.where(keep, logps.to(dtype), zero)  # noqa: E741  (spec's symbol); gradient exactly 0 where masked
    if old_logps is None:
        l_old = l.detach()
    else:
        l_old = torch.where(keep, old_logps.detach().to(dtype), zero)

    # advantages broadcast to [B, T]; masked positions (e.g. sample-masked rows) may hold garbage, so zero them
    adv = torch.where(keep, _per_row(advantages, dtype), zero)
    adv_has_token_dim = advantages.dim() == 2 and advantages.shape[1] == length and length != 1

    n = m.sum(dim=1)  # n_i: [B]

    # ------------------------------------------------------------------ section 3: importance ratio
    d = l - l_old  # [B, T]
    if importance_sampling_level == "token":
        rho = torch.exp(d)  # [B, T]
        log_s = None
    else:  # "sequence" (GSPO)
        log_s = (m * d).sum(dim=1) / torch.clamp(n, min=1)  # [B]
        rho = torch.exp(log_s).unsqueeze(1).expand(batch, length)  # [B, T]; gradient reaches every token of row i

    # ------------------------------------------------------------------ section 3: policy term L
    if loss_type in CLIP_FAMILY_LOSS_TYPES:
        rho_c = torch.clamp(rho, max=delta) if delta is not None else rho
        clipped = torch.clamp(rho, 1 - epsilon, 1 + epsilon_high)
        per_token = -torch.minimum(rho_c * adv, clipped * adv)
    elif loss_type == "cispo":
        cap = epsilon_high
        per_token = -torch.clamp(rho, max=cap).detach() * adv * l
    else:  # "sapo"
        tau = torch.where(
            adv > 0,
            torch.full_like(adv, sapo_temperature_pos),
            torch.full_like(adv, sapo_temperature_neg),
        )
        per_token = -(4 / tau) * torch.sigmoid(tau * (rho - 1)) * adv

    if is_weights is not None:
        w = torch.where(keep, _per_row(is_weights, dtype), zero)  # [B, T]
        per_token = per_token * w

    # ------------------------------------------------------------------ section 4: KL penalty
    kl = None
    if beta != 0:
        assert ref_logps is not None  # checked above
        l_ref = torch.where(keep, ref_logps.detach().to(dtype), zero)
        r = l_ref - l
        if kl_clamp is not None:
            r = torch.clamp(r, -kl_clamp, kl_clamp)
        if kl_estimator == "k3":
            kl = torch.exp(r) - r - 1
        elif kl_estimator == "k1":
            kl = -r
        else:  # "k2"
            kl = r**2 / 2
        if use_bias_correction_kl:
            kl = rho * kl
        per_token = per_token + beta * kl

    # ------------------------------------------------------------------ section 5: aggregation
    weighted = per_token * m  # [B, T]
    total_tokens = torch.clamp(m.sum(), min=1)
    if loss_type in ("grpo", "sapo"):
        loss = (weighted.sum(dim=1) / torch.clamp(n, min=1)).sum() / batch
    elif loss_type == "bnpo":
        loss = weighted.sum() / total_tokens
    elif loss_type == "dr_grpo":
        loss = weighted.sum() / (batch * max_completion_length)
    elif loss_type in ("dapo", "cispo"):
        if num_items_in_batch is None:
            denominator = total_tokens
        elif isinstance(num_items_in_batch, Tensor):
            denominator = num_items_in_batch.detach().to(device=logps.device, dtype=dtype)
        else:
            denominator = float(num_items_in_batch)
        loss = weighted.sum() / denominator
    else:  # "luspo"
        loss = weighted.sum() / batch
    if isinstance(loss_scale, Tensor):
        loss = loss * loss_scale.detach().to(device=logps.device, dtype=dtype)
    else:
        loss = loss * loss_scale

    # ------------------------------------------------------------------ section 7: metrics
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        if kl is not None:
            metrics["kl"] = (kl * m).sum() / total_tokens

        # conditions use the uncapped rho; one value per row when the ratio and the advantage are per row
        per_row_shares = importance_sampling_level == "sequence" and not adv_has_token_dim
        if per_row_shares:
            assert log_s is not None
            rho_cond = torch.exp(log_s)  # [B]; a row with no tokens has s_i = 1
            adv_cond = advantages.detach().to(dtype).reshape(batch)  # [B], every row counted
        else:
            rho_cond = rho  # [B, T]
            adv_cond = adv  # [B, T]

        def share(condition: Tensor) -> Tensor:
            if per_row_shares:
                return condition.to(dtype).sum() / batch
            return (condition.to(dtype) * m).sum() / total_tokens

        if loss_type == "cispo":
            metrics["cispo_clip_ratio"] = share((rho_cond > epsilon_high) & (adv_cond > 0))
        else:
            low = (rho_cond < 1 - epsilon) & (adv_cond < 0)
            high = (rho_cond > 1 + epsilon_high) & (adv_cond > 0)
            metrics["clip_ratio/low_mean"] = share(low)
            metrics["clip_ratio/high_mean"] = share(high)
            metrics["clip_ratio/region_mean"] = share(low | high)

    return GRPOLossOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------------------------
# Section 2: log-probs and entropy from logits
# ---------------------------------------------------------------------------------------------------------------


class SelectiveLogSoftmax(NamedTuple):
    """Per-token log-probs of the chosen ids, and the entropy of each row's distribution (None unless asked)."""

    logps: Tensor
    entropy: Tensor | None


def validate_selective_log_softmax_args(logits: Tensor, ids: Tensor, temperature: float) -> float:
    """Checks selective_log_softmax's arguments (shared with the native op's wrapper); returns the temperature.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    _check_tensor("logits", logits)
    _check_tensor("ids", ids)
    _check_floating("logits", logits)
    _check_integer("ids", ids)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [N, V] or [B, T, V], got {tuple(logits.shape)}")
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"ids must have shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(ids.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least one entry (V >= 1)")
    _check_same_device("logits", logits, ids=ids)
    return _check_positive("temperature", temperature)


def selective_log_softmax(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> SelectiveLogSoftmax:
    """Log-probs of the chosen tokens and the entropy (spec section 2), through a materialized log_softmax.

    ``z = logits / temperature``; ``logps = z[id] - logsumexp(z)``;
    ``entropy = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args:
        logits: ``[..., V]`` floating; ``logits[..., :]`` scores ``ids[...]`` (positions already aligned).
        ids: ``[...]`` integer token ids in ``[0, V)``.
        temperature: > 0.
        return_entropy: also return the entropy.

    Returns:
        :class:`SelectiveLogSoftmax` of ``[...]`` tensors in the compute dtype (float32, float64 for float64
        logits), differentiable with respect to ``logits``.
    """
    temperature = validate_selective_log_softmax_args(logits, ids, temperature)
    z = logits.to(_compute_dtype(logits)) / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    logps = torch.gather(log_probs, -1, ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if return_entropy:
        probs = log_probs.exp()
        # 0 * log 0 = 0: a -inf logit (a vocabulary entry masked out) contributes nothing
        entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1)
    return SelectiveLogSoftmax(logps, entropy)


# ---------------------------------------------------------------------------------------------------------------
# Sections 2-7 together: the loss from logits or from hidden states
# ---------------------------------------------------------------------------------------------------------------


def grpo_loss_from_logits(
    logits: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    **loss_kwargs,
) -> GRPOLossOutput:
    """:func:`selective_log_softmax` then :func:`grpo_loss`, through a materialized log_softmax.

    Args:
        logits: ``[B, T, V]`` (or ``[N, V]`` with ``N = B * T``) floating; ``logits[i, t]`` scores
            ``completion_ids[i, t]``.
        completion_ids: ``[B, T]`` (or ``[N]``) integer ids.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        temperature: > 0.
        **loss_kwargs: :func:`grpo_loss`' options.

    Returns:
        GRPOLossOutput: :func:`grpo_loss`'s, with ``metrics["entropy"]``, the mean entropy over the kept tokens.
    """
    batch, length = completion_mask.shape
    logits = logits.reshape(batch, length, logits.shape[-1])
    selected = selective_log_softmax(
        logits, completion_ids.reshape(batch, length), temperature=temperature, return_entropy=True
    )
    out = grpo_loss(selected.logps, advantages, completion_mask, **loss_kwargs)
    mask = completion_mask.to(selected.logps.dtype)
    sample_mask = loss_kwargs.get("sample_mask")
    if sample_mask is not None:
        mask = mask * sample_mask.to(mask.dtype).unsqueeze(1)
    entropy = torch.where(mask != 0, selected.entropy.detach(), 0.0)
    out.metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return out


def grpo_loss_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    **loss_kwargs,
) -> GRPOLossOutput:
    """``logits = hidden @ lm_head_weight.T (+ lm_head_bias)``, then :func:`grpo_loss_from_logits`.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]``.
        lm_head_weight: ``[V, H]``.
        completion_ids: ``[B, T]`` (or ``[N]``).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        lm_head_bias: ``[V]`` or None.
        temperature: > 0.
        chunk_size: ignored (the reference materializes every logit).
        **loss_kwargs: :func:`grpo_loss`' options.

    Returns:
        GRPOLossOutput, with ``metrics["entropy"]``.
    """
    logits = hidden @ lm_head_weight.t()
    if lm_head_bias is not None:
        logits = logits + lm_head_bias
    return grpo_loss_from_logits(
        logits, completion_ids, advantages, completion_mask, temperature=temperature, **loss_kwargs
    )
