"""Checks of the loss options and of grpo_loss' arguments, shared by every loss (the kernels' wrappers and the
reference) and the trainer's ``GRPOConfig``; and their per-call fast path. Part of :mod:`grpo_ext.validation`.

:func:`validate_loss_option_values` holds the one definition of the options' ranges and
:func:`validate_grpo_loss_args` every check of a call. The kernels' wrappers call :func:`resolve_grpo_loss_args`
(or :func:`resolve_fused_loss_args`), which gives the same result with less work per call: the options that are
plain values are checked once per distinct set of values (a cache), and the tensors by a one-pass predicate that
only says whether they certainly pass. Whenever the fast path cannot vouch for a call, the full validation runs and
raises its own error, so every bad input gets the same message either way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from .options import (
    CISPO_DEFAULT_CAP,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    NATIVE_OPTION_NAMES,
    SPLIT_NUMBERS,
    LossOptions,
)
from .tensors import (
    check_finite_mask,
    check_floating,
    check_per_row,
    check_same_device,
    check_scalar_tensor_device,
    check_shape,
    check_tensor,
    shapes_only,
)
from .values import (
    check_bool,
    check_choice,
    check_finite,
    check_finite_positive,
    check_int,
    check_non_negative,
    check_positive,
    check_real_number,
)


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
        check_number_tensor("loss_scale", loss_scale, check_finite)
    else:
        loss_scale = check_finite("loss_scale", loss_scale)
    if max_completion_length is not None:
        max_completion_length = check_int("max_completion_length", max_completion_length, 1)
    if isinstance(num_items, Tensor):
        check_number_tensor("num_items_in_batch", num_items, check_positive)
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


def check_number_tensor(name: str, t: Tensor, check_value: Callable[[str, object], float]) -> None:
    """Raises ValueError unless ``t``, a number given as a tensor, is 0-dim, floating or integer, and (on the CPU,
    outside torch.compile) holds a value that ``check_value`` accepts. A device tensor's value is not read here (that
    would sync the host with the device): the kernels read it, and a bad one gives a NaN or infinite loss."""
    if t.dim() != 0:
        raise ValueError(f"{name} must be a Python number or a 0-dim tensor, got a tensor of shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be a floating or integer tensor (a number), got {t.dtype}")
    if t.device.type == "cpu" and not torch.compiler.is_compiling() and not shapes_only(t):
        check_value(name, t.item())


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
    check_finite_mask("completion_mask", completion_mask)
    if options.sample_mask is not None:
        check_finite_mask("sample_mask", options.sample_mask)
    if options.beta != 0 and options.ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    if isinstance(options.num_items_in_batch, Tensor):
        check_scalar_tensor_device("num_items_in_batch", options.num_items_in_batch, "logps", logps)
        # its value is not checked: that would sync the host with the device
    if options.max_completion_length is None:
        options = options._replace(max_completion_length=length)
    return options


# ---------------------------------------------------------------------------------------------------------------
# The per-call fast path of the kernels' wrappers
# ---------------------------------------------------------------------------------------------------------------

#: The options that are tensors (or None); passed to the native ops as they are.
_TENSOR_OPTIONS = frozenset({"old_logps", "ref_logps", "is_weights", "sample_mask", "policy_weights"})
#: The options that may be given as a tensor, taken per call instead of through the cache.
_PER_CALL_OPTIONS = _TENSOR_OPTIONS | {"loss_scale", "num_items_in_batch"}
_FIELD_INDEX = {name: i for i, name in enumerate(LossOptions._fields)}
_ARG_INDEX = {name: i for i, name in enumerate(NATIVE_OPTION_NAMES)}


@functools.lru_cache(maxsize=256)
def _checked_option_values(key: tuple) -> tuple[LossOptions, tuple]:
    """:func:`validate_loss_option_values` of the options in ``key`` and their native arguments, once per ``key``.

    Args:
        key: ``(name, type, value[, sign])`` of each option given as a plain value; the type keeps ``True`` apart
            from ``1``, and the sign ``0.0`` from ``-0.0`` (equal, with one hash).

    Raises:
        TypeError: an unknown option name; ValueError: a bad value, or a tensor option given as something other
            than a tensor or None (the caller then runs the full validation, which names the problem).
    """
    options = validate_loss_option_values(LossOptions(**{item[0]: item[2] for item in key}))
    if any(options[_FIELD_INDEX[name]] is not None for name in _TENSOR_OPTIONS):
        raise ValueError("a tensor option given as a plain value")
    return options, options.op_args()


def _certainly_valid_tensors(
    batch: int, length: int, device: torch.device, advantages: object, completion_mask: object, per_call: dict,
    beta: float,
) -> bool:  # fmt: skip
    """Whether the tensors pass every check of :func:`validate_grpo_loss_args` (False: maybe not, let it tell).

    Args:
        batch, length: ``B`` and ``T`` of the ``[B, T]`` log-probs (both >= 1); ``device``: theirs.
        advantages: should be a floating ``[B]``, ``[B, 1]`` or ``[B, T]`` tensor; ``completion_mask``: ``[B, T]``.
        per_call: the options given as tensors, by name (:data:`_PER_CALL_OPTIONS`).
        beta: the checked ``beta`` (``ref_logps`` is required unless it is 0).
    """
    shape = (batch, length)
    per_row = ((batch,), (batch, 1), shape)
    if not (isinstance(advantages, Tensor) and advantages.is_floating_point() and advantages.shape in per_row
            and advantages.device == device):  # fmt: skip
        return False
    mask = completion_mask
    if not (isinstance(mask, Tensor) and mask.shape == shape and mask.device == device):
        return False
    # only CPU masks are read for NaN and inf (reading a GPU one would sync; a fake one has no values)
    on_cpu = device.type == "cpu" and not shapes_only(mask)
    if on_cpu and mask.is_floating_point() and not torch.isfinite(mask).all():
        return False
    if not per_call:
        return beta == 0
    get = per_call.get
    for name, shapes in (("old_logps", (shape,)), ("ref_logps", (shape,)), ("is_weights", per_row),
                         ("policy_weights", per_row)):  # fmt: skip
        t = get(name)
        if t is not None and not (t.is_floating_point() and t.shape in shapes and t.device == device):
            return False
    sample_mask = get("sample_mask")
    if sample_mask is not None:
        if not (sample_mask.shape == (batch,) and sample_mask.device == device):
            return False
        if on_cpu and sample_mask.is_floating_point() and not torch.isfinite(sample_mask).all():
            return False
    for name, check_value in (("loss_scale", check_finite), ("num_items_in_batch", check_positive)):
        t = get(name)
        if t is None:
            continue
        if not (t.dim() == 0 and (t.device == device or t.device.type == "cpu")):
            return False
        try:
            check_number_tensor(name, t, check_value)
        except ValueError:
            return False
    return beta == 0 or "ref_logps" in per_call


def _resolve_fast(
    batch: int, length: int, device: torch.device, advantages: object, completion_mask: object, kwargs: dict
) -> tuple[LossOptions, tuple] | None:
    """``(options, native option arguments)`` as the full validation would return them, or None where it must run."""
    per_call: dict[str, Tensor] = {}
    key = []
    for name, value in kwargs.items():
        if isinstance(value, Tensor):
            if name not in _PER_CALL_OPTIONS:  # e.g. a 0-dim max_completion_length: the full path takes it
                return None
            per_call[name] = value
        elif isinstance(value, float) and value == 0.0:
            key.append((name, float, value, math.copysign(1.0, value)))
        else:
            key.append((name, value.__class__, value))
    try:
        options, option_args = _checked_option_values(tuple(key))
    except (TypeError, ValueError):  # unhashable, unknown or bad: the full validation names the problem
        return None
    if not _certainly_valid_tensors(batch, length, device, advantages, completion_mask, per_call, options.beta):
        return None
    if per_call or options.max_completion_length is None:
        fields, args = list(options), list(option_args)
        for name, value in per_call.items():
            fields[_FIELD_INDEX[name]] = value
            if name in SPLIT_NUMBERS:  # as LossOptions.op_args splits it
                split = SPLIT_NUMBERS[name]
                args[_ARG_INDEX[name]], args[_ARG_INDEX[split.tensor_arg]] = split.placeholder, value
            else:
                args[_ARG_INDEX[name]] = value
        if options.max_completion_length is None:  # its default, T
            fields[_FIELD_INDEX["max_completion_length"]] = args[_ARG_INDEX["max_completion_length"]] = length
        options, option_args = LossOptions._make(fields), tuple(args)
    return options, option_args


def resolve_grpo_loss_args(
    function: str, logps: Tensor, advantages: Tensor, completion_mask: Tensor, kwargs: dict
) -> tuple[LossOptions, tuple]:
    """The options of a grpo_loss call, checked and resolved, and the native ops' arguments for them.

    The same checks, results and errors as ``validate_grpo_loss_args(logps, advantages, completion_mask,
    LossOptions.from_kwargs(function, kwargs))``, with the options that are plain values checked once per distinct
    set of them (see the module docstring).

    Args:
        function: the public function's name, for the error about an unknown keyword.
        logps: ``[B, T]`` floating log-probs.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]``.
        kwargs: the loss options as the caller passed them (keywords of :class:`LossOptions`).

    Returns:
        ``(options, option_args)``: the resolved :class:`LossOptions` and ``options.op_args()``.

    Raises:
        TypeError: an unknown keyword. ValueError: naming the bad argument and what was expected.
    """
    fast_path = not torch.compiler.is_compiling() and isinstance(logps, Tensor)
    if fast_path and logps.is_floating_point() and logps.dim() == 2:
        batch, length = logps.shape
        if batch and length:
            fast = _resolve_fast(batch, length, logps.device, advantages, completion_mask, kwargs)
            if fast is not None:
                return fast
    options = validate_grpo_loss_args(logps, advantages, completion_mask, LossOptions.from_kwargs(function, kwargs))
    return options, options.op_args()


def resolve_fused_loss_args(
    function: str, batch: int, length: int, like: Tensor, advantages: Tensor, completion_mask: Tensor, kwargs: dict
) -> tuple[LossOptions, tuple]:
    """:func:`resolve_grpo_loss_args` for a loss that computes its ``[B, T]`` log-probs itself (from logits or hidden
    states): they are checked as a float32 ``[B, T]`` stand-in on ``like``'s device, named ``logps`` in errors."""
    if batch and length and not torch.compiler.is_compiling():
        fast = _resolve_fast(batch, length, like.device, advantages, completion_mask, kwargs)
        if fast is not None:
            return fast
    stand_in = torch.empty((batch, length), dtype=torch.float32, device=like.device)
    options = validate_grpo_loss_args(stand_in, advantages, completion_mask, LossOptions.from_kwargs(function, kwargs))
    return options, options.op_args()
