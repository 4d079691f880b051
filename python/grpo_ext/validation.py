"""Argument validation shared by every implementation of the ops (the kernels' wrappers and the reference).

Each ``validate_<op>_args`` raises a ``ValueError`` naming the bad argument and what was expected, without syncing
the host, and returns the arguments normalized; both implementations call it, so they fail alike.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from .ops.options import (
    BASELINES,
    CISPO_DEFAULT_CAP,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    SINGLETON_GROUPS,
    LogitOptions,
    LossOptions,
)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Raises ValueError unless ``value`` is one of ``allowed``; the message lists the allowed values."""
    if not isinstance(value, str) or value not in allowed:
        allowed_list = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {allowed_list}; got {value!r}")


def check_int(name: str, value: object, minimum: int) -> int:
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


def check_real_number(name: str, value: object) -> float:
    """Returns ``value`` as a Python float, raising ValueError unless it is a real (non-bool) Python number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number > 0 (NaN is rejected)."""
    x = check_real_number(name, value)
    if not x > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def check_finite_positive(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a finite number > 0."""
    x = check_real_number(name, value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return x


def validate_logit_options(
    temperature: object, logit_scale: object = 1.0, logit_softcap: object = None
) -> LogitOptions:
    """Checks the logits options (docs/math.md section 2) of every op that reads logits; returns them as floats.

    Raises:
        ValueError: temperature not > 0, logit_scale not finite and > 0, or logit_softcap neither None nor finite > 0.
    """
    return LogitOptions(
        check_positive("temperature", temperature),
        check_finite_positive("logit_scale", logit_scale),
        None if logit_softcap is None else check_finite_positive("logit_softcap", logit_softcap),
    )


def check_non_negative(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a number >= 0 (NaN is rejected)."""
    x = check_real_number(name, value)
    if not x >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def check_finite(name: str, value: object) -> float:
    """Returns ``value`` as a float, raising ValueError unless it is a finite real number (not NaN, not +-inf)."""
    x = check_real_number(name, value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return x


def check_scalar_tensor_device(name: str, t: Tensor, reference_name: str, reference: Tensor) -> None:
    """Raises ValueError unless the 0-dim tensor ``t`` is on ``reference``'s device or on the CPU (read as a number)."""
    if t.device != reference.device and t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device} but {reference_name} is on device {reference.device}; a tensor "
            f"{name} must be on {reference.device} or on the CPU"
        )


def check_no_nan_mask(name: str, mask: Tensor) -> None:
    """Raises ValueError if a floating-point mask on the CPU holds NaN.

    A mask's values are 0 or 1; NaN there is a caller's mistake. Only CPU tensors are checked: reading a CUDA
    tensor's values would sync the host with the device, so there a NaN mask entry makes the loss NaN instead.
    """
    if mask.is_floating_point() and mask.device.type == "cpu" and bool(torch.isnan(mask).any()):
        raise ValueError(f"{name} holds NaN; a mask's values must be 0 or 1")


def check_tensor(name: str, value: object) -> Tensor:
    """Raises ValueError unless ``value`` is a torch.Tensor."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` has a floating-point dtype."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_integer(name: str, t: Tensor) -> None:
    """Raises ValueError unless ``t`` has an integer (non-bool) dtype."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int64), got {t.dtype}")


def check_shape(name: str, t: Tensor, allowed: Sequence[tuple[int, ...]], described: str) -> None:
    """Raises ValueError unless ``tuple(t.shape)`` is one of ``allowed``.

    Args:
        name: the argument name used in the message.
        t: the tensor to check.
        allowed: the accepted concrete shapes.
        described: the accepted shapes in symbols for the message, e.g. ``"[B,T]=(4, 7)"``.
    """
    if tuple(t.shape) not in [tuple(s) for s in allowed]:
        raise ValueError(f"{name} must have shape {described}, got {tuple(t.shape)}")


def check_same_device(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raises ValueError if any tensor in ``others`` (None entries are skipped) is not on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on device {t.device} but {reference_name} is on device {reference.device}; "
                "all tensors must be on the same device"
            )


def reward_weights_tensor(
    reward_weights: Sequence[float] | Tensor | None, num_rewards: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Returns the ``[K]`` reward weights in ``dtype`` on ``device`` (ones when None), validating the length."""
    if reward_weights is None:
        return torch.ones(num_rewards, dtype=dtype, device=device)
    if isinstance(reward_weights, Tensor) and reward_weights.device != device:
        raise ValueError(
            f"reward_weights is on device {reward_weights.device} but rewards is on device {device}; "
            "pass them on the rewards' device"
        )
    try:
        w = torch.as_tensor(reward_weights, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"reward_weights must be a sequence of numbers or a 1-D tensor: {err}") from None
    if w.dim() != 1:
        raise ValueError(f"reward_weights must be 1-D with K={num_rewards} entries, got shape {tuple(w.shape)}")
    if w.shape[0] != num_rewards:
        raise ValueError(f"reward_weights must have K={num_rewards} entries, got {w.shape[0]}")
    if not isinstance(reward_weights, Tensor) and not all(math.isfinite(x) for x in w.tolist()):
        # (a tensor's values are not read: on a GPU that would sync the host)
        raise ValueError(f"reward_weights must be finite numbers, got {list(reward_weights)}")
    return w


def validate_group_advantages_args(
    rewards: Tensor,
    group_size: int | None,
    scale_rewards: str,
    baseline: str,
    multi_objective_aggregation: str,
    eps: float,
    std_ddof: int,
    singleton_groups: str = "zero",
    group_ids: Tensor | None = None,
    num_groups: int | None = None,
) -> tuple[int | None, Tensor | None, int, float, int]:
    """Checks group_advantages' arguments (shared with the native op's wrapper).

    Returns:
        ``(group_size, group_ids, num_groups, eps, std_ddof)``; ``num_groups`` is ``B / G`` for contiguous groups
        and, with ``group_ids``, the given number or ``max(group_ids) + 1`` (a host sync on CUDA).

    Raises:
        ValueError: naming the bad argument and what was expected; ``group_ids`` on the meta device without
            ``num_groups``, ``singleton_groups="verl"`` with ``normalize_then_sum``. The values of CUDA
            ``group_ids`` are checked only when ``num_groups`` is derived from them (the kernel asserts on the device
            otherwise).
    """
    check_tensor("rewards", rewards)
    check_floating("rewards", rewards)
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must have shape [B] or [B,K], got {tuple(rewards.shape)}")
    batch = rewards.shape[0]
    if group_ids is None:
        if group_size is None:
            raise ValueError("group_advantages needs group_size (contiguous groups) or group_ids (groups in any order)")
        if num_groups is not None:
            raise ValueError(f"num_groups={num_groups} is only taken with group_ids (contiguous groups: B / G)")
        group_size = check_int("group_size", group_size, 1)
        if batch % group_size != 0:
            raise ValueError(f"rewards.shape[0]={batch} is not divisible by group_size={group_size}")
        num_groups = batch // group_size
    else:
        group_ids, num_groups = _check_group_ids(rewards, group_size, group_ids, num_groups)
    check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    check_choice("baseline", baseline, BASELINES)
    check_choice("multi_objective_aggregation", multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    eps = check_positive("eps", eps)
    std_ddof = check_int("std_ddof", std_ddof, 0)
    check_choice("singleton_groups", singleton_groups, SINGLETON_GROUPS)
    if singleton_groups == "verl" and multi_objective_aggregation == "normalize_then_sum":
        # GDPO z-scores the combined reward over the batch, not per group: no group convention applies
        raise ValueError(
            "singleton_groups='verl' applies to multi_objective_aggregation='sum_then_normalize' only, got "
            "multi_objective_aggregation='normalize_then_sum' (which z-scores over the batch); use "
            "singleton_groups='zero' with it"
        )
    return group_size, group_ids, num_groups, eps, std_ddof


def _check_group_ids(rewards: Tensor, group_size: object, group_ids: Tensor, num_groups: int | None) -> tuple:
    """``(group_ids, num_groups)`` checked: an int64 ``[B]`` tensor on ``rewards``' device, ids in range."""
    batch = rewards.shape[0]
    if group_size is not None:
        raise ValueError(f"pass group_size or group_ids, not both (got group_size={group_size!r} and group_ids)")
    check_tensor("group_ids", group_ids)
    if group_ids.dtype != torch.int64:
        raise ValueError(f"group_ids must be an int64 tensor, got {group_ids.dtype}")
    if tuple(group_ids.shape) != (batch,):
        raise ValueError(f"group_ids must have shape [B]=({batch},) (one group per row), got {tuple(group_ids.shape)}")
    if group_ids.device != rewards.device:
        raise ValueError(f"group_ids is on device {group_ids.device} but rewards is on device {rewards.device}")
    derive = num_groups is None
    if derive and batch and group_ids.device.type == "meta":  # a shape-only trace: there are no ids to count
        raise ValueError("num_groups is required with group_ids on the meta device (its default, max(group_ids) + 1, "
                         "reads the ids): pass num_groups")  # fmt: skip
    if not derive:
        num_groups = check_int("num_groups", num_groups, 0)
    if batch and (derive or group_ids.device.type == "cpu"):  # reading the values syncs a CUDA tensor's host
        low, high = int(group_ids.min()), int(group_ids.max())
        if low < 0:
            raise ValueError(f"group_ids must be >= 0, got {low}")
        if derive:
            num_groups = high + 1
        elif high >= num_groups:
            raise ValueError(f"group_ids must be < num_groups={num_groups}, got {high}")
    return group_ids, 0 if num_groups is None else num_groups


def validate_process_advantages_args(
    step_rewards: Tensor, step_end: Tensor, group_size: int, seq_len: int, eps: float, std_ddof: int
) -> tuple[int, int, float, int]:
    """Checks process_advantages' arguments (shared with the native op's wrapper); returns the normalized numbers.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    check_tensor("step_rewards", step_rewards)
    check_tensor("step_end", step_end)
    check_floating("step_rewards", step_rewards)
    check_integer("step_end", step_end)
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must have shape [B,S], got {tuple(step_rewards.shape)}")
    check_shape("step_end", step_end, [tuple(step_rewards.shape)], f"[B,S]={tuple(step_rewards.shape)}")
    check_same_device("step_rewards", step_rewards, step_end=step_end)
    group_size = check_int("group_size", group_size, 1)
    seq_len = check_int("seq_len", seq_len, 1)
    eps = check_positive("eps", eps)
    std_ddof = check_int("std_ddof", std_ddof, 0)
    batch = step_rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(f"step_rewards.shape[0]={batch} is not divisible by group_size={group_size}")
    return group_size, seq_len, eps, std_ddof


def check_per_row(name: str, t: Tensor, batch: int, length: int) -> None:
    """Raises ValueError unless ``t`` is a floating ``[B]``, ``[B,1]`` or ``[B,T]`` tensor."""
    check_floating(name, t)
    check_shape(name, t, [(batch,), (batch, 1), (batch, length)], f"[B]=({batch},), [B,1] or [B,T]={(batch, length)}")


def check_bool(name: str, value: object) -> bool:
    """Returns ``value``, raising ValueError unless it is a bool (``"false"`` from a YAML or command line is true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def validate_loss_option_values(options: LossOptions) -> LossOptions:
    """Checks the loss options that are plain values, the one definition of their ranges (docs/math.md sections 3-5).

    The loss functions run it (through :func:`validate_grpo_loss_args`), and so does the trainer's ``GRPOConfig`` on
    construction, so a bad option fails before a model loads. The tensors and what depends on the inputs' shapes
    (``max_completion_length``'s default ``T``, a tensor's shape and device) are :func:`validate_grpo_loss_args`' part.

    Args:
        options: the loss options as the caller passed them.

    Returns:
        The options with their numbers as Python floats/ints, ``epsilon_high`` resolved (``epsilon``, or 5.0 for
        cispo); a tensor ``loss_scale`` or ``num_items_in_batch`` is returned as given, when 0-dim.

    Raises:
        ValueError: a message that starts with the bad option's name and says what was expected.
    """
    epsilon_high, delta, kl_clamp = options.epsilon_high, options.delta, options.kl_clamp
    loss_scale, num_items, max_completion_length = (
        options.loss_scale, options.num_items_in_batch, options.max_completion_length,
    )  # fmt: skip
    check_choice("loss_type", options.loss_type, LOSS_TYPES)
    check_choice("kl_estimator", options.kl_estimator, KL_ESTIMATORS)
    check_choice("importance_sampling_level", options.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    epsilon = check_non_negative("epsilon", options.epsilon)  # 0: no lower clip range (a legitimate setting)
    if epsilon_high is None:
        epsilon_high = CISPO_DEFAULT_CAP if options.loss_type == "cispo" else epsilon
    epsilon_high = check_non_negative("epsilon_high", epsilon_high)
    if delta is not None:
        delta = check_real_number("delta", delta)
        if not delta > 1:
            raise ValueError(f"delta must exceed 1 (it caps the ratio from above, and rho = 1 on-policy), got {delta}")
    beta = check_non_negative("beta", check_finite("beta", options.beta))
    if kl_clamp is not None:
        kl_clamp = check_positive("kl_clamp", kl_clamp)
    # tau = +inf would make SAPO's gate a step: no gradient in the kernels, NaN in the reference
    sapo = {name: check_finite_positive(name, getattr(options, name))
            for name in ("sapo_temperature_pos", "sapo_temperature_neg")}  # fmt: skip
    vespo = {name: check_finite(name, getattr(options, name))
             for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}  # fmt: skip
    if isinstance(loss_scale, Tensor):
        if loss_scale.dim() != 0:
            shape = tuple(loss_scale.shape)
            raise ValueError(f"loss_scale must be a Python number or a 0-dim tensor, got shape {shape}")
    else:
        loss_scale = check_finite("loss_scale", loss_scale)
    if max_completion_length is not None:
        max_completion_length = check_int("max_completion_length", max_completion_length, 1)
    if isinstance(num_items, Tensor):
        if num_items.dim() != 0:
            raise ValueError(
                f"num_items_in_batch must be a Python number or a 0-dim tensor, got a tensor of shape "
                f"{tuple(num_items.shape)}"
            )
    elif num_items is not None:
        check_positive("num_items_in_batch", num_items)
    return options._replace(
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        delta=delta,
        beta=beta,
        kl_clamp=kl_clamp,
        use_bias_correction_kl=check_bool("use_bias_correction_kl", options.use_bias_correction_kl),
        max_completion_length=max_completion_length,
        **sapo,
        **vespo,
        loss_scale=loss_scale,
        skip_empty_rows=check_bool("skip_empty_rows", options.skip_empty_rows),
    )


def validate_grpo_loss_args(
    logps: Tensor, advantages: Tensor, completion_mask: Tensor, options: LossOptions
) -> LossOptions:
    """Checks grpo_loss' arguments (shared with the native op's wrapper) without syncing the host.

    Args:
        logps: ``[B, T]`` log-probs (or a stand-in of that shape when the caller computes them).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        options: the loss options as the caller passed them.

    Returns:
        The options normalized: numbers as Python floats/ints, defaults resolved (``epsilon_high``: ``epsilon``, or
        5.0 for cispo; ``max_completion_length``: ``T``).

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    options = validate_loss_option_values(options)

    check_tensor("logps", logps)
    check_floating("logps", logps)
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape [B,T], got {tuple(logps.shape)}")
    batch, length = logps.shape
    if batch == 0:
        raise ValueError("logps has an empty batch (B == 0); at least one completion is required")
    if length == 0:
        raise ValueError("logps has no token positions (T == 0); at least one position is required")
    bt = f"[B,T]={(batch, length)}"

    check_tensor("advantages", advantages)
    check_per_row("advantages", advantages, batch, length)
    check_tensor("completion_mask", completion_mask)
    check_shape("completion_mask", completion_mask, [(batch, length)], bt)
    for name, t in (("old_logps", options.old_logps), ("ref_logps", options.ref_logps)):
        if t is not None:
            check_tensor(name, t)
            check_floating(name, t)
            check_shape(name, t, [(batch, length)], bt)
    for name, t in (("is_weights", options.is_weights), ("policy_weights", options.policy_weights)):
        if t is not None:
            check_tensor(name, t)
            check_per_row(name, t, batch, length)
    if options.sample_mask is not None:
        check_tensor("sample_mask", options.sample_mask)
        check_shape("sample_mask", options.sample_mask, [(batch,)], f"[B]=({batch},)")
    check_same_device(
        "logps",
        logps,
        advantages=advantages,
        completion_mask=completion_mask,
        old_logps=options.old_logps,
        ref_logps=options.ref_logps,
        is_weights=options.is_weights,
        sample_mask=options.sample_mask,
        policy_weights=options.policy_weights,
    )
    if isinstance(options.loss_scale, Tensor):
        check_scalar_tensor_device("loss_scale", options.loss_scale, "logps", logps)
    check_no_nan_mask("completion_mask", completion_mask)
    if options.sample_mask is not None:
        check_no_nan_mask("sample_mask", options.sample_mask)
    if options.beta != 0 and options.ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    if isinstance(options.num_items_in_batch, Tensor):
        check_scalar_tensor_device("num_items_in_batch", options.num_items_in_batch, "logps", logps)
        # its value is not checked: that would sync the host with the device
    if options.max_completion_length is None:
        options = options._replace(max_completion_length=length)
    return options


def validate_selective_log_softmax_args(
    logits: Tensor, ids: Tensor, temperature: float, logit_scale: float = 1.0, logit_softcap: float | None = None
) -> LogitOptions:
    """Checks selective_log_softmax's arguments (shared with the native op's wrapper); returns the logits options.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    check_tensor("logits", logits)
    check_tensor("ids", ids)
    check_floating("logits", logits)
    check_integer("ids", ids)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [N, V] or [B, T, V], got {tuple(logits.shape)}")
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"ids must have shape {tuple(logits.shape[:-1])} (logits without V), got {tuple(ids.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least one entry (V >= 1)")
    check_same_device("logits", logits, ids=ids)
    return validate_logit_options(temperature, logit_scale, logit_softcap)
