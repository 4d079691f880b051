"""Typed, documented wrappers of the native ops, with their fake (meta) and autograd registrations.

Each public function validates its options, calls ``torch.ops.grpo_ext.<op>`` (a hand-written CPU or CUDA kernel)
and returns the same NamedTuples as :mod:`grpo_ext.reference`. The math is ``spec/grpo-math.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .reference import (
    GroupAdvantages,
    GRPOLossOutput,
    SelectiveLogSoftmax,
    _check_int,
    _check_positive,
    _reward_weights_tensor,
    validate_group_advantages_args,
    validate_grpo_loss_args,
    validate_process_advantages_args,
    validate_selective_log_softmax_args,
)

OP_NAMES = (
    "group_advantages",
    "process_advantages",
    "grpo_loss_forward",
    "grpo_loss_backward",
    "selective_log_softmax_forward",
    "selective_log_softmax_backward",
    "grpo_logits_pass",
    "grpo_logits_pass_",
    "scale_grad_",
)

# Order of the metrics vector the forward kernel returns (csrc/loss_math.h, MetricSlot).
_METRIC_KL, _METRIC_LOW, _METRIC_HIGH, _METRIC_REGION, _METRIC_CISPO = range(5)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------------------------


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
    """Group-normalized advantages (spec section 1), one kernel launch.

    Args:
        rewards: ``[B]`` or ``[B, K]`` floating tensor (K reward functions); NaN means "not scored". The ``G``
            completions of one prompt are contiguous rows.
        group_size: ``G``; ``B % G`` must be 0.
        reward_weights: ``K`` weights (default ones).
        scale_rewards: ``"group"`` (std of the group), ``"batch"`` (std of the batch) or ``"none"`` (Dr. GRPO).
        baseline: ``"mean"`` (GRPO) or ``"leave_one_out"`` (RLOO).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"`` (GDPO).
        eps: added to the std (never inside a sqrt).
        std_ddof: delta degrees of freedom of every std (1: Bessel, as TRL and verl).

    Returns:
        GroupAdvantages: ``advantages [B]``, ``group_mean [B/G]``, ``group_std [B/G]`` (float32, float64 for float64
        rewards) and ``zero_std [B/G]`` bool. No NaN ever leaves the op.
    """
    group_size, eps, std_ddof = validate_group_advantages_args(
        rewards, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof
    )
    if reward_weights is not None:
        num_rewards = rewards.shape[1] if rewards.dim() == 2 else 1
        weights_dtype = reward_weights.dtype if isinstance(reward_weights, Tensor) else torch.float64
        reward_weights = _reward_weights_tensor(reward_weights, num_rewards, weights_dtype, rewards.device)
    out = torch.ops.grpo_ext.group_advantages(
        rewards, reward_weights, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof
    )
    return GroupAdvantages(*out)


@torch.library.register_fake("grpo_ext::group_advantages")
def _group_advantages_fake(rewards, reward_weights, group_size, scale_rewards, baseline, aggregation, eps, std_ddof):
    torch._check(rewards.dim() in (1, 2), lambda: f"rewards must have shape [B] or [B, K], got {tuple(rewards.shape)}")
    batch = rewards.shape[0]
    torch._check(batch % group_size == 0, lambda: f"rewards.shape[0] is not divisible by group_size={group_size}")
    dtype = _accumulate_dtype(rewards.dtype)
    groups = batch // group_size
    return (
        rewards.new_empty((batch,), dtype=dtype),
        rewards.new_empty((groups,), dtype=dtype),
        rewards.new_empty((groups,), dtype=dtype),
        rewards.new_empty((groups,), dtype=torch.bool),
    )


# ---------------------------------------------------------------------------------------------------------------
# process_advantages
# ---------------------------------------------------------------------------------------------------------------


def process_advantages(
    step_rewards: Tensor,
    step_end: Tensor,
    group_size: int,
    seq_len: int,
    *,
    eps: float = 1e-4,
    std_ddof: int = 1,
) -> Tensor:
    """Process-supervision token advantages (DeepSeekMath 4.1.3; spec section 1).

    Args:
        step_rewards: ``[B, S]`` floating tensor of step rewards, NaN-padded.
        step_end: ``[B, S]`` int64, index of the last token of each step (``-1`` for padding).
        group_size: ``G``; all valid step rewards of a group are normalized together.
        seq_len: ``T`` of the output.
        eps: added to the group std.
        std_ddof: delta degrees of freedom of the std.

    Returns:
        ``[B, T]`` float32 (float64 for float64 rewards): ``A[i, t]`` is the sum of the normalized rewards of the
        steps of row ``i`` that end at or after ``t``.
    """
    group_size, seq_len, eps, std_ddof = validate_process_advantages_args(
        step_rewards, step_end, group_size, seq_len, eps, std_ddof
    )
    return torch.ops.grpo_ext.process_advantages(step_rewards, step_end, group_size, seq_len, eps, std_ddof)


@torch.library.register_fake("grpo_ext::process_advantages")
def _process_advantages_fake(step_rewards, step_end, group_size, seq_len, eps, std_ddof):
    torch._check(step_rewards.dim() == 2, lambda: "step_rewards must have shape [B, S]")
    return step_rewards.new_empty((step_rewards.shape[0], seq_len), dtype=_accumulate_dtype(step_rewards.dtype))


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss
# ---------------------------------------------------------------------------------------------------------------


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
    num_items_in_batch: float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    loss_scale: float = 1.0,
) -> GRPOLossOutput:
    """Fused GRPO loss, metrics and gradient from per-token log-probs (spec sections 3-7).

    One forward kernel computes the loss, the metrics and d loss / d logps; backward only scales that gradient by
    the incoming gradient. Only ``logps`` receives a gradient.

    Args:
        logps: ``[B, T]`` float32/bfloat16/float16 (or float64) log-probs of the sampled tokens under the policy.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]`` (process supervision).
        completion_mask: ``[B, T]`` bool, integer or float mask.
        old_logps: ``[B, T]`` log-probs of the sampling policy; None means on-policy (``old = logps.detach()``).
        ref_logps: ``[B, T]`` reference-model log-probs; required when ``beta != 0``.
        is_weights: ``[B, T]``, ``[B, 1]`` or ``[B]`` rollout importance-sampling weights (multiply the policy term).
        sample_mask: ``[B]`` rows to keep (zero-std masking); a dropped row counts in no denominator.
        loss_type: one of ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``, ``cispo``, ``sapo``.
        epsilon: lower clip ``1 - epsilon``.
        epsilon_high: upper clip ``1 + epsilon_high`` (defaults to ``epsilon``); for ``cispo`` the absolute cap on
            the ratio (default 5.0).
        delta: two-sided clipping cap on the unclipped ratio (INTELLECT-2), must exceed 1.
        beta: KL coefficient.
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        kl_clamp: clamp of ``ref - logps`` before the estimator.
        use_bias_correction_kl: multiply the KL by the importance ratio (DeepSeek-V3.2).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        max_completion_length: ``dr_grpo``'s constant denominator (default ``T``).
        num_items_in_batch: ``dapo``/``cispo`` denominator (number or one-element tensor; default: masked tokens).
        sapo_temperature_pos: SAPO temperature for positive advantages.
        sapo_temperature_neg: SAPO temperature for non-positive advantages.
        loss_scale: multiplies the loss and its gradient (gradient accumulation or a loss scaler).

    Returns:
        GRPOLossOutput: ``loss`` (0-dim float32; float64 for float64 logps) with autograd to ``logps``, and
        ``metrics`` (0-dim, detached) under TRL's names.
    """
    (epsilon, epsilon_high, delta, beta, kl_clamp, sapo_temperature_pos, sapo_temperature_neg, loss_scale,
     max_completion_length) = validate_grpo_loss_args(
        logps, advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask, loss_type, epsilon,
        epsilon_high, delta, beta, kl_estimator, kl_clamp, importance_sampling_level, max_completion_length,
        num_items_in_batch, sapo_temperature_pos, sapo_temperature_neg, loss_scale,
    )  # fmt: skip
    num_items_value, num_items_tensor = None, None
    if isinstance(num_items_in_batch, Tensor):
        num_items_tensor = num_items_in_batch
    elif num_items_in_batch is not None:
        num_items_value = float(num_items_in_batch)

    compute_grad = torch.is_grad_enabled() and logps.requires_grad
    op_args = (
        logps, advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask,
        num_items_value, num_items_tensor, loss_type, float(epsilon), float(epsilon_high), delta, float(beta),
        kl_estimator, kl_clamp, bool(use_bias_correction_kl), importance_sampling_level, int(max_completion_length),
        float(sapo_temperature_pos), float(sapo_temperature_neg), float(loss_scale), compute_grad,
    )  # fmt: skip
    if compute_grad and not torch.compiler.is_compiling():
        loss, metrics_vec = _GRPOLossFunction.apply(*op_args)
    else:  # torch.compile traces the op itself, through its register_autograd registration
        loss, metrics_vec, _, _ = torch.ops.grpo_ext.grpo_loss_forward(*op_args)
    metrics: dict[str, Tensor] = {}
    if beta != 0:
        metrics["kl"] = metrics_vec[_METRIC_KL]
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = metrics_vec[_METRIC_CISPO]
    else:
        metrics["clip_ratio/low_mean"] = metrics_vec[_METRIC_LOW]
        metrics["clip_ratio/high_mean"] = metrics_vec[_METRIC_HIGH]
        metrics["clip_ratio/region_mean"] = metrics_vec[_METRIC_REGION]
    return GRPOLossOutput(loss, metrics)


@torch.library.register_fake("grpo_ext::grpo_loss_forward")
def _grpo_loss_forward_fake(logps, advantages, completion_mask, *args):
    compute_grad = args[-1]
    torch._check(logps.dim() == 2, lambda: "logps must have shape [B, T]")
    dtype = _accumulate_dtype(logps.dtype)
    grad_shape = tuple(logps.shape) if compute_grad else (0,)
    return (
        logps.new_empty((), dtype=dtype),
        logps.new_empty((5,), dtype=dtype),
        logps.new_empty(grad_shape, dtype=dtype),
        logps.new_empty((), dtype=dtype),
    )


@torch.library.register_fake("grpo_ext::grpo_loss_backward")
def _grpo_loss_backward_fake(grad_loss, grad_raw, grad_scale, out_dtype):
    return grad_raw.new_empty(grad_raw.shape, dtype=out_dtype)


def _grpo_loss_setup_context(ctx, inputs, output) -> None:
    _, metrics, grad_raw, grad_scale = output
    ctx.logps_dtype = inputs[0].dtype
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(grad_raw, grad_scale)
    ctx.mark_non_differentiable(metrics, grad_raw, grad_scale)


def _grpo_loss_backward(ctx, grad_loss, *unused_grads):
    grad_raw, grad_scale = ctx.saved_tensors
    if grad_raw.dim() != 2:
        raise RuntimeError(
            "grpo_loss: the forward ran without computing the gradient (logps did not require grad or grad mode "
            "was off); run it again with grad enabled"
        )
    grad_logps = torch.ops.grpo_ext.grpo_loss_backward(grad_loss, grad_raw, grad_scale, ctx.logps_dtype)
    return (grad_logps,) + (None,) * (ctx.num_inputs - 1)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_forward", _grpo_loss_backward, setup_context=_grpo_loss_setup_context
)


class _GRPOLossFunction(torch.autograd.Function):
    """Eager autograd for grpo_loss_forward, the same math as the registration above.

    torch.library's autograd wrapper rebuilds the 23-argument schema on every call (about 0.3 ms of Python on a
    CPU); calling the op inside an autograd.Function, where grad mode is off, skips that path.
    """

    @staticmethod
    def forward(ctx, *op_args):
        loss, metrics, grad_raw, grad_scale = torch.ops.grpo_ext.grpo_loss_forward(*op_args)
        _grpo_loss_setup_context(ctx, op_args, (loss, metrics, grad_raw, grad_scale))
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        return _grpo_loss_backward(ctx, grad_loss)


# ---------------------------------------------------------------------------------------------------------------
# selective_log_softmax
# ---------------------------------------------------------------------------------------------------------------


def selective_log_softmax(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> SelectiveLogSoftmax:
    """Log-probs of the chosen tokens (and the entropy) with no ``[N, V]`` temporary (spec section 2).

    The forward reads each logits row once (CUDA: one online pass; CPU: two vectorized passes over the row); the
    backward recomputes the softmax from the saved per-row logsumexp and writes the gradient in the logits' dtype.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` float32/bfloat16/float16 (or float64); ``logits[..., :]`` scores
            ``ids[...]``, positions already aligned (the caller drops the last position).
        ids: ``[N]`` or ``[B, T]`` int64 token ids in ``[0, V)``.
        temperature: ``z = logits / temperature``, > 0.
        return_entropy: also return ``logsumexp(z) - sum_v softmax(z)_v z_v`` per row.

    Returns:
        SelectiveLogSoftmax: ``logps`` (and ``entropy`` or None), shaped like ``ids``, float32 (float64 for float64
        logits), differentiable with respect to ``logits``.
    """
    temperature = validate_selective_log_softmax_args(logits, ids, temperature)
    lead_shape = ids.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = ids.reshape(-1)
    args = (flat_logits, flat_ids, float(temperature), bool(return_entropy))
    if torch.is_grad_enabled() and logits.requires_grad and not torch.compiler.is_compiling():
        logps, entropy = _SelectiveLogSoftmaxFunction.apply(*args)
    else:
        logps, entropy, _ = torch.ops.grpo_ext.selective_log_softmax_forward(*args)
    return SelectiveLogSoftmax(logps.reshape(lead_shape), entropy.reshape(lead_shape) if return_entropy else None)


@torch.library.register_fake("grpo_ext::selective_log_softmax_forward")
def _selective_log_softmax_forward_fake(logits, ids, temperature, return_entropy):
    torch._check(logits.dim() == 2, lambda: "logits must have shape [N, V]")
    dtype = _accumulate_dtype(logits.dtype)
    rows = logits.shape[0]
    return (
        logits.new_empty((rows,), dtype=dtype),
        logits.new_empty((rows,) if return_entropy else (0,), dtype=dtype),
        logits.new_empty((rows, 2), dtype=dtype),
    )


@torch.library.register_fake("grpo_ext::selective_log_softmax_backward")
def _selective_log_softmax_backward_fake(grad_logps, grad_entropy, logits, ids, row_stats, temperature):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _selective_log_softmax_setup_context(ctx, inputs, output) -> None:
    logits, ids, temperature, _ = inputs
    row_stats = output[2]
    ctx.temperature = temperature
    ctx.save_for_backward(logits, ids, row_stats)
    ctx.mark_non_differentiable(row_stats)


def _selective_log_softmax_backward(ctx, grad_logps, grad_entropy, *unused):
    logits, ids, row_stats = ctx.saved_tensors
    if grad_logps is None:
        grad_logps = torch.zeros(logits.shape[0], dtype=row_stats.dtype, device=logits.device)
    if grad_entropy is not None and grad_entropy.numel() == 0:
        grad_entropy = None
    grad_logits = torch.ops.grpo_ext.selective_log_softmax_backward(
        grad_logps, grad_entropy, logits, ids, row_stats, ctx.temperature
    )
    return grad_logits, None, None, None


torch.library.register_autograd(
    "grpo_ext::selective_log_softmax_forward",
    _selective_log_softmax_backward,
    setup_context=_selective_log_softmax_setup_context,
)


class _SelectiveLogSoftmaxFunction(torch.autograd.Function):
    """Eager autograd for selective_log_softmax_forward (see _GRPOLossFunction for why not the registration)."""

    @staticmethod
    def forward(ctx, *op_args):
        logps, entropy, row_stats = torch.ops.grpo_ext.selective_log_softmax_forward(*op_args)
        _selective_log_softmax_setup_context(ctx, op_args, (logps, entropy, row_stats))
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        return _selective_log_softmax_backward(ctx, grad_logps, grad_entropy)


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss_from_logits and grpo_loss_from_hidden: the fused loss (spec sections 2-7)
# ---------------------------------------------------------------------------------------------------------------

# grpo_loss' keyword arguments and their defaults: the loss options both fused functions accept.
_LOSS_KWARG_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(grpo_loss).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
}


class _LossOptions(NamedTuple):
    """grpo_loss' options, checked and resolved, in the order the native ops take them after the masks."""

    old_logps: Tensor | None
    ref_logps: Tensor | None
    is_weights: Tensor | None
    sample_mask: Tensor | None
    num_items_value: float | None
    num_items_tensor: Tensor | None
    loss_type: str
    epsilon: float
    epsilon_high: float
    delta: float | None
    beta: float
    kl_estimator: str
    kl_clamp: float | None
    use_bias_correction_kl: bool
    importance_sampling_level: str
    max_completion_length: int
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    loss_scale: float

    def loss_op_args(self, logps: Tensor, advantages: Tensor, mask: Tensor, compute_grad: bool) -> tuple:
        return (
            logps, advantages, mask, self.old_logps, self.ref_logps, self.is_weights, self.sample_mask,
            self.num_items_value, self.num_items_tensor, self.loss_type, self.epsilon, self.epsilon_high, self.delta,
            self.beta, self.kl_estimator, self.kl_clamp, self.use_bias_correction_kl, self.importance_sampling_level,
            self.max_completion_length, self.sapo_temperature_pos, self.sapo_temperature_neg, self.loss_scale,
            compute_grad,
        )  # fmt: skip

    def pass_op_args(self, logits: Tensor, ids: Tensor, row_offset: int, advantages: Tensor, mask: Tensor,
                     token_grad: Tensor | None, temperature: float, compute_grad: bool) -> tuple:  # fmt: skip
        return (
            logits, ids, row_offset, advantages, mask, self.old_logps, self.ref_logps, self.is_weights,
            self.sample_mask, self.num_items_value, self.num_items_tensor, token_grad, self.loss_type, self.epsilon,
            self.epsilon_high, self.delta, self.beta, self.kl_estimator, self.kl_clamp, self.use_bias_correction_kl,
            self.max_completion_length, self.sapo_temperature_pos, self.sapo_temperature_neg, self.loss_scale,
            temperature, compute_grad,
        )  # fmt: skip


def _logits_rows(logits: Tensor) -> int:
    return logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]


@torch.library.register_fake("grpo_ext::grpo_logits_pass")
def _grpo_logits_pass_fake(logits, *args):
    compute_grad = args[-1]
    rows, dtype = _logits_rows(logits), _accumulate_dtype(logits.dtype)
    grad_shape = (rows, logits.shape[-1]) if compute_grad else (0,)
    return logits.new_empty((rows,), dtype=dtype), logits.new_empty((rows,), dtype=dtype), logits.new_empty(grad_shape)


@torch.library.register_fake("grpo_ext::grpo_logits_pass_")
def _grpo_logits_pass_inplace_fake(logits, *args):
    rows, dtype = _logits_rows(logits), _accumulate_dtype(logits.dtype)
    return logits.new_empty((rows,), dtype=dtype), logits.new_empty((rows,), dtype=dtype)


@torch.library.register_fake("grpo_ext::scale_grad_")
def _scale_grad_fake(grad, factor):
    return None


def _resolve_loss_options(
    function: str, batch: int, length: int, like: Tensor, advantages: Tensor, completion_mask: Tensor, kwargs: dict
) -> _LossOptions:
    unknown = sorted(set(kwargs) - set(_LOSS_KWARG_DEFAULTS))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword argument(s) {unknown}; it takes grpo_loss' options")
    k = {**_LOSS_KWARG_DEFAULTS, **kwargs}
    # the log-probs are computed here: a [B, T] stand-in lets grpo_loss' own checks name every other argument
    stand_in = torch.empty((batch, length), dtype=torch.float32, device=like.device)
    (epsilon, epsilon_high, delta, beta, kl_clamp, tau_pos, tau_neg, loss_scale, max_len) = validate_grpo_loss_args(
        stand_in, advantages, completion_mask, k["old_logps"], k["ref_logps"], k["is_weights"], k["sample_mask"],
        k["loss_type"], k["epsilon"], k["epsilon_high"], k["delta"], k["beta"], k["kl_estimator"], k["kl_clamp"],
        k["importance_sampling_level"], k["max_completion_length"], k["num_items_in_batch"],
        k["sapo_temperature_pos"], k["sapo_temperature_neg"], k["loss_scale"],
    )  # fmt: skip
    num_items = k["num_items_in_batch"]
    return _LossOptions(
        k["old_logps"], k["ref_logps"], k["is_weights"], k["sample_mask"],
        None if num_items is None or isinstance(num_items, Tensor) else float(num_items),
        num_items if isinstance(num_items, Tensor) else None,
        k["loss_type"], float(epsilon), float(epsilon_high), delta, float(beta), k["kl_estimator"], kl_clamp,
        bool(k["use_bias_correction_kl"]), k["importance_sampling_level"], int(max_len), float(tau_pos),
        float(tau_neg), float(loss_scale),
    )  # fmt: skip


def _metrics_dict(metrics_vec: Tensor, entropy: Tensor, options: _LossOptions) -> dict[str, Tensor]:
    metrics: dict[str, Tensor] = {}
    if options.beta != 0:
        metrics["kl"] = metrics_vec[_METRIC_KL]
    if options.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = metrics_vec[_METRIC_CISPO]
    else:
        metrics["clip_ratio/low_mean"] = metrics_vec[_METRIC_LOW]
        metrics["clip_ratio/high_mean"] = metrics_vec[_METRIC_HIGH]
        metrics["clip_ratio/region_mean"] = metrics_vec[_METRIC_REGION]
    metrics["entropy"] = entropy
    return metrics


def _masked_mean_entropy(entropy: Tensor, completion_mask: Tensor, sample_mask: Tensor | None) -> Tensor:
    """Mean entropy over the kept tokens (the kernels write 0 for masked rows, which are never read)."""
    mask = completion_mask.to(entropy.dtype)
    if sample_mask is not None:
        mask = mask * sample_mask.to(entropy.dtype).unsqueeze(1)
    return (entropy.view_as(mask) * mask).sum() / mask.sum().clamp(min=1.0)


def _logits_loss_forward(
    logits: Tensor,
    ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    options: _LossOptions,
    temperature: float,
    compute_grad: bool,
    inplace: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused forward on ``[N, V]``/``[B, T, V]`` logits: (loss, metrics vector, mean entropy, d loss/d logits).

    Token-level losses: one pass over the logits (log-probs, entropy and the gradient), then the [B, T] loss op
    for the loss and metrics. Sequence level: the log-probs first, the loss op's d loss / d logp, then a second
    pass that writes the gradient. In place, the gradient is written over ``logits`` (returned as the gradient).
    """
    batch, length = completion_mask.shape
    ops = torch.ops.grpo_ext
    pass_op = ops.grpo_logits_pass_ if inplace else ops.grpo_logits_pass
    token_level = options.importance_sampling_level == "token"
    if compute_grad and not token_level:
        logps, entropy, _ = ops.grpo_logits_pass(
            *options.pass_op_args(logits, ids, 0, advantages, completion_mask, None, temperature, False)
        )
        loss, metrics, grad_raw, grad_scale = ops.grpo_loss_forward(
            *options.loss_op_args(logps.view(batch, length), advantages, completion_mask, True)
        )
        token_grad = (grad_raw * grad_scale).reshape(-1)
        out = pass_op(*options.pass_op_args(logits, ids, 0, advantages, completion_mask, token_grad, temperature, True))
    else:
        out = pass_op(*options.pass_op_args(logits, ids, 0, advantages, completion_mask, None, temperature,
                                            compute_grad))  # fmt: skip
        logps, entropy = out[0], out[1]
        loss, metrics, _, _ = ops.grpo_loss_forward(
            *options.loss_op_args(logps.view(batch, length), advantages, completion_mask, False)
        )
    grad = None
    if compute_grad:
        grad = logits if inplace else out[2].view(logits.shape)
    return loss, metrics, _masked_mean_entropy(entropy, completion_mask, options.sample_mask), grad


def _check_ids_and_mask(rows: int, device: torch.device, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Checks ids and mask against ``rows`` scoring rows; returns the ids flattened to ``[N]``."""
    if not isinstance(completion_mask, Tensor) or completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be a [B, T] tensor, got {getattr(completion_mask, 'shape', None)}")
    batch, length = completion_mask.shape
    if rows != batch * length:
        raise ValueError(f"there are {rows} token rows, but completion_mask [B, T]={(batch, length)} has "
                         f"{batch * length}")  # fmt: skip
    if not isinstance(completion_ids, Tensor) or completion_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"completion_ids must be an int64 tensor, got {getattr(completion_ids, 'dtype', None)}")
    if completion_ids.numel() != rows or completion_ids.dim() not in (1, 2):
        raise ValueError(f"completion_ids must have shape [B, T]={(batch, length)} or [N]=({rows},), "
                         f"got {tuple(completion_ids.shape)}")  # fmt: skip
    if completion_ids.device != device or completion_mask.device != device:
        raise ValueError(f"completion_ids and completion_mask must be on device {device}")
    return completion_ids.reshape(-1)


def _check_logits_shapes(logits: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Checks the logits/ids/mask shapes; returns the ids flattened to ``[N]``."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape [B, T, V] or [N, V], got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least one entry (V >= 1)")
    if logits.dim() == 3 and isinstance(completion_mask, Tensor) and completion_mask.dim() == 2:
        if tuple(logits.shape[:2]) != tuple(completion_mask.shape):
            raise ValueError(f"logits must have shape [B, T, V] with [B, T]={tuple(completion_mask.shape)} "
                             f"(completion_mask's), got {tuple(logits.shape)}")  # fmt: skip
    rows = logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]
    return _check_ids_and_mask(rows, logits.device, completion_ids, completion_mask)


def _scale_grad(grad: Tensor, grad_loss: Tensor) -> Tensor:
    """``grad *= grad_loss`` in place; a no-op on the device when grad_loss == 1 (no host sync, no memory pass)."""
    if grad.dim() == 1:
        torch.ops.grpo_ext.scale_grad_(grad.view(1, -1), grad_loss)
    else:
        torch.ops.grpo_ext.scale_grad_(grad, grad_loss)
    return grad


def _take_saved_grads(ctx, function: str) -> tuple:
    grads = ctx.saved_grads
    if grads is None:
        raise RuntimeError(
            f"{function}: backward ran twice through the same forward; its gradients were computed in the forward "
            "and handed over in the first backward (retain_graph=True is not supported). Run the forward again."
        )
    ctx.saved_grads = None  # handed over: the buffers are scaled in place and given to autograd
    return grads


class _LogitsLossFunction(torch.autograd.Function):
    """Eager autograd for the fused logits loss: the gradient is computed in the forward and kept on ``ctx``.

    It is kept as a plain attribute, not with save_for_backward: in the in-place mode it is the logits' own
    storage, whose version counter the forward bumps on purpose.
    """

    @staticmethod
    def forward(ctx, logits, ids, advantages, completion_mask, options, temperature, inplace):
        loss, metrics, entropy, grad = _logits_loss_forward(
            logits, ids, advantages, completion_mask, options, temperature, True, inplace
        )
        ctx.saved_grads = (grad,)
        ctx.mark_non_differentiable(metrics, entropy)
        return loss, metrics, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics, grad_entropy):
        (grad,) = _take_saved_grads(ctx, "grpo_loss_from_logits")
        return _scale_grad(grad, grad_loss), None, None, None, None, None, None


# The loss options as they follow the tensors in the two composite ops' schemas (the order of _LossOptions).
_LOSS_OPTIONS_SCHEMA = (
    "Tensor? old_logps, Tensor? ref_logps, Tensor? is_weights, Tensor? sample_mask, float? num_items_value, "
    "Tensor? num_items_tensor, str loss_type, float epsilon, float epsilon_high, float? delta, float beta, "
    "str kl_estimator, float? kl_clamp, bool use_bias_correction_kl, str importance_sampling_level, "
    "int max_completion_length, float sapo_temperature_pos, float sapo_temperature_neg, float loss_scale"
)

# The fused loss as one opaque op for torch.compile: (loss, metrics vector, mean entropy, d loss / d logits).
torch.library.define(
    "grpo_ext::grpo_loss_from_logits",
    f"(Tensor logits, Tensor ids, Tensor advantages, Tensor completion_mask, {_LOSS_OPTIONS_SCHEMA}, "
    "float temperature) -> (Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("grpo_ext::grpo_loss_from_logits", "CompositeExplicitAutograd")
def _grpo_loss_from_logits_impl(logits, ids, advantages, completion_mask, *options_and_temperature):
    *options, temperature = options_and_temperature
    return _logits_loss_forward(logits, ids, advantages, completion_mask, _LossOptions(*options), temperature, True,
                                False)  # fmt: skip


@torch.library.register_fake("grpo_ext::grpo_loss_from_logits")
def _grpo_loss_from_logits_fake(logits, ids, advantages, completion_mask, *args):
    dtype = _accumulate_dtype(logits.dtype)
    return (
        logits.new_empty((), dtype=dtype),
        logits.new_empty((5,), dtype=dtype),
        logits.new_empty((), dtype=dtype),
        torch.empty_like(logits, memory_format=torch.contiguous_format),
    )


def _logits_op_setup_context(ctx, inputs, output) -> None:
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _logits_op_backward(ctx, grad_loss, *unused):
    (grad,) = ctx.saved_tensors
    return (grad * grad_loss.to(grad.dtype),) + (None,) * (ctx.num_inputs - 1)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_from_logits", _logits_op_backward, setup_context=_logits_op_setup_context
)


def grpo_loss_from_logits(
    logits: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    inplace_grad: bool = False,
    **loss_kwargs,
) -> GRPOLossOutput:
    """Fused GRPO loss from logits: log-probs, entropy, loss, metrics and d loss / d logits (spec sections 2-7).

    Token-level losses read each logits row once for its softmax statistics and again, right after, to write its
    gradient (the second read is served from cache); no ``[N, V]`` float temporary is made. Sequence-level
    losses (GSPO) take a second pass, since a row's ratio needs all its log-probs first. Masked rows are never read
    and get a zero gradient. The backward only scales the gradient by the incoming one (skipped when it is 1).

    Args:
        logits: ``[B, T, V]`` (rows may be strided, e.g. ``model_logits[:, :-1]``; V contiguous) or ``[N, V]`` with
            ``N = B * T``, float32/bfloat16/float16 (or float64); ``logits[i, t]`` scores ``completion_ids[i, t]``.
        completion_ids: ``[B, T]`` (or ``[N]``) int64 token ids in ``[0, V)``.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]`` bool/int/float.
        temperature: ``z = logits / temperature``, > 0.
        inplace_grad: write the gradient over ``logits`` instead of a new buffer (no extra memory). ``logits`` must
            be the output of an op (a model's lm_head, say), not a leaf; its version counter is bumped, so autograd
            raises if anything saved it for backward, and its values are the gradient afterwards. Eager mode only.
        **loss_kwargs: every keyword of :func:`grpo_loss`, with the same meaning.

    Returns:
        GRPOLossOutput: as :func:`grpo_loss` (``loss`` float32, with autograd to ``logits``), with
        ``metrics["entropy"]`` the mean entropy over the kept tokens.
    """
    flat_ids = _check_logits_shapes(logits, completion_ids, completion_mask)
    temperature = _check_positive("temperature", temperature)
    batch, length = completion_mask.shape
    options = _resolve_loss_options("grpo_loss_from_logits", batch, length, logits, advantages, completion_mask,
                                    loss_kwargs)  # fmt: skip
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        if inplace_grad:
            raise ValueError("inplace_grad=True needs logits contiguous in the vocabulary dimension (stride(-1) == 1)")
        logits = logits.contiguous()
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace_grad:
        if torch.compiler.is_compiling():
            raise ValueError("inplace_grad=True is for eager mode; under torch.compile use inplace_grad=False")
        if compute_grad and logits.is_leaf:
            raise ValueError(
                "inplace_grad=True would overwrite a leaf tensor with its own gradient; pass logits produced by an op "
                "(e.g. the lm_head's output) or use inplace_grad=False"
            )
    if not compute_grad:
        loss, metrics, entropy, _ = _logits_loss_forward(
            logits, flat_ids, advantages, completion_mask, options, temperature, False, False
        )
    elif torch.compiler.is_compiling():
        loss, metrics, entropy, _ = torch.ops.grpo_ext.grpo_loss_from_logits(logits, flat_ids, advantages, completion_mask,
                                                              *options, temperature)  # fmt: skip
    else:
        loss, metrics, entropy = _LogitsLossFunction.apply(
            logits, flat_ids, advantages, completion_mask, options, temperature, inplace_grad
        )
        if inplace_grad:
            # the values are the gradient now: anything that saved the logits for backward must fail loudly
            torch.autograd.graph.increment_version(logits)
    return GRPOLossOutput(loss, _metrics_dict(metrics, entropy, options))


def _default_chunk_size(rows: int, vocab: int, element_size: int) -> int:
    """Rows per chunk: the largest power of two whose logits fit in 256 MiB (GEMMs stay large, memory bounded)."""
    fit = max(1, (256 << 20) // max(1, vocab * element_size))
    return min(rows, 1 << (fit.bit_length() - 1))


def _accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 whatever the dtype of ``a`` and ``b``, without an [M, K] temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:  # cuBLAS: half-precision inputs, float32 accumulator and output
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _hidden_loss_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    options: _LossOptions,
    temperature: float,
    chunk_size: int,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The chunked forward: (loss, metrics vector, mean entropy, d/d hidden, d/d weight, d/d bias).

    Per chunk of token rows: logits = hidden @ weight.T (+ bias) through torch (cuBLAS), the fused logits kernel
    in place (log-probs, entropy, and the gradient over the chunk's logits), then grad_hidden = g @ weight and
    grad_weight += g.T @ hidden (float32 accumulator). Sequence-level losses first run every chunk for the
    log-probs alone, then recompute each chunk's logits for the gradient.
    """
    batch, length = completion_mask.shape
    rows, vocab = hidden.shape[0], weight.shape[0]
    need_hidden, need_weight, need_bias = needs
    compute_grad = any(needs)
    acc = _accumulate_dtype(hidden.dtype)
    logps = torch.empty(rows, dtype=acc, device=hidden.device)
    entropy = torch.empty(rows, dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    ops = torch.ops.grpo_ext

    def chunk_logits(start: int, end: int) -> Tensor:
        x = hidden[start:end]
        return torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()

    def backward_through_chunk(start: int, end: int, grad_logits: Tensor) -> None:
        if need_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if need_weight:
            _accumulate_product(grad_weight, grad_logits.t(), hidden[start:end])
        if need_bias:
            grad_bias.add_(grad_logits.sum(0, dtype=acc))

    token_level = options.importance_sampling_level == "token"
    two_phase = compute_grad and not token_level
    for start in range(0, rows, chunk_size):
        end = min(rows, start + chunk_size)
        logits = chunk_logits(start, end)
        grad_now = compute_grad and token_level
        op = ops.grpo_logits_pass_ if grad_now else ops.grpo_logits_pass
        out = op(*options.pass_op_args(logits, ids[start:end], start, advantages, completion_mask, None, temperature,
                                       grad_now))  # fmt: skip
        logps[start:end] = out[0]
        entropy[start:end] = out[1]
        if grad_now:
            backward_through_chunk(start, end, logits)  # the logits buffer holds the gradient now
    loss, metrics, grad_raw, grad_scale = ops.grpo_loss_forward(
        *options.loss_op_args(logps.view(batch, length), advantages, completion_mask, two_phase)
    )
    if two_phase:
        token_grad = (grad_raw * grad_scale).reshape(-1)
        for start in range(0, rows, chunk_size):
            end = min(rows, start + chunk_size)
            logits = chunk_logits(start, end)
            ops.grpo_logits_pass_(*options.pass_op_args(logits, ids[start:end], start, advantages, completion_mask,
                                                        token_grad[start:end], temperature, True))  # fmt: skip
            backward_through_chunk(start, end, logits)
    if grad_weight is not None and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None and bias is not None and grad_bias.dtype != bias.dtype:
        grad_bias = grad_bias.to(bias.dtype)
    entropy_mean = _masked_mean_entropy(entropy, completion_mask, options.sample_mask)
    return loss, metrics, entropy_mean, grad_hidden, grad_weight, grad_bias


class _HiddenLossFunction(torch.autograd.Function):
    """Eager autograd for the chunked hidden-state loss: gradients computed in the forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, advantages, completion_mask, options, temperature, chunk_size):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, metrics, entropy, *grads = _hidden_loss_forward(
            hidden, weight, bias, ids, advantages, completion_mask, options, temperature, chunk_size, needs
        )
        ctx.saved_grads = tuple(grads)
        ctx.mark_non_differentiable(metrics, entropy)
        return loss, metrics, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics, grad_entropy):
        grads = _take_saved_grads(ctx, "grpo_loss_from_hidden")
        scaled = tuple(None if g is None else _scale_grad(g, grad_loss) for g in grads)
        return scaled + (None,) * 6


# The chunked loss as one opaque op for torch.compile; every gradient computed (bias' empty without bias).
torch.library.define(
    "grpo_ext::grpo_loss_from_hidden",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor ids, Tensor advantages, Tensor completion_mask, "
    f"{_LOSS_OPTIONS_SCHEMA}, float temperature, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("grpo_ext::grpo_loss_from_hidden", "CompositeExplicitAutograd")
def _grpo_loss_from_hidden_impl(hidden, weight, bias, ids, advantages, completion_mask, *rest):
    *options, temperature, chunk_size = rest
    loss, metrics, entropy, grad_hidden, grad_weight, grad_bias = _hidden_loss_forward(
        hidden, weight, bias, ids, advantages, completion_mask, _LossOptions(*options), temperature, chunk_size,
        (True, True, bias is not None),
    )  # fmt: skip
    if grad_bias is None:
        grad_bias = weight.new_empty((0,))
    return loss, metrics, entropy, grad_hidden, grad_weight, grad_bias


@torch.library.register_fake("grpo_ext::grpo_loss_from_hidden")
def _grpo_loss_from_hidden_fake(hidden, weight, bias, *args):
    dtype = _accumulate_dtype(hidden.dtype)
    return (
        hidden.new_empty((), dtype=dtype),
        hidden.new_empty((5,), dtype=dtype),
        hidden.new_empty((), dtype=dtype),
        torch.empty_like(hidden),
        torch.empty_like(weight),
        torch.empty_like(bias) if bias is not None else weight.new_empty((0,)),
    )


def _hidden_op_setup_context(ctx, inputs, output) -> None:
    ctx.num_inputs = len(inputs)
    ctx.has_bias = inputs[2] is not None
    ctx.save_for_backward(*output[3:])
    ctx.mark_non_differentiable(*output[1:])


def _hidden_op_backward(ctx, grad_loss, *unused):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    scale = grad_loss.to(grad_hidden.dtype)
    grads = (grad_hidden * scale, grad_weight * scale, grad_bias * scale if ctx.has_bias else None)
    return grads + (None,) * (ctx.num_inputs - 3)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_from_hidden", _hidden_op_backward, setup_context=_hidden_op_setup_context
)


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
    """Fused GRPO loss from the last hidden states: never materializes the ``[N, V]`` logits (spec sections 2-7).

    Chunks over tokens: each chunk's logits (``chunk_size x V``) go through the fused logits kernel in place, and
    the gradients for ``hidden``, ``lm_head_weight`` and ``lm_head_bias`` are formed chunk by chunk (the weight
    and bias ones accumulated in float32), all in the forward; the backward only scales them by the incoming
    gradient (skipped when it is 1). Peak extra memory: the gradients plus one chunk of logits.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]`` (``N = B * T``) float32/bfloat16/float16: the hidden states that score
            ``completion_ids`` (positions already aligned).
        lm_head_weight: ``[V, H]``, same dtype as ``hidden``.
        completion_ids: ``[B, T]`` (or ``[N]``) int64 ids in ``[0, V)``.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]`` bool/int/float.
        lm_head_bias: ``[V]`` or None.
        temperature: ``z = (hidden @ W.T + b) / temperature``, > 0.
        chunk_size: token rows per chunk (default: the largest power of two whose logits fit in 256 MiB).
        **loss_kwargs: every keyword of :func:`grpo_loss`, with the same meaning.

    Returns:
        GRPOLossOutput: as :func:`grpo_loss_from_logits` (``loss`` with autograd to hidden, weight and bias).
    """
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be a floating [B, T, H] or [N, H] tensor, got {getattr(hidden, 'shape', None)}")
    size = hidden.shape[-1]
    if not isinstance(lm_head_weight, Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != size:
        raise ValueError(f"lm_head_weight must have shape [V, H] with H={size} (hidden's), "
                         f"got {tuple(getattr(lm_head_weight, 'shape', ()))}")  # fmt: skip
    if lm_head_weight.dtype != hidden.dtype or lm_head_weight.device != hidden.device:
        raise ValueError(f"lm_head_weight must match hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
                         f"got {lm_head_weight.dtype}, {lm_head_weight.device}")  # fmt: skip
    vocab = lm_head_weight.shape[0]
    if vocab < 1:
        raise ValueError("lm_head_weight must have at least one row (V >= 1)")
    if lm_head_bias is not None and (
        not isinstance(lm_head_bias, Tensor) or tuple(lm_head_bias.shape) != (vocab,)
        or lm_head_bias.dtype != hidden.dtype or lm_head_bias.device != hidden.device
    ):  # fmt: skip
        raise ValueError(f"lm_head_bias must be a [V]=({vocab},) tensor of hidden's dtype and device")
    flat_hidden = hidden.reshape(-1, size)
    flat_ids = _check_ids_and_mask(flat_hidden.shape[0], hidden.device, completion_ids, completion_mask)
    temperature = _check_positive("temperature", temperature)
    batch, length = completion_mask.shape
    options = _resolve_loss_options("grpo_loss_from_hidden", batch, length, hidden, advantages, completion_mask,
                                    loss_kwargs)  # fmt: skip
    rows = flat_hidden.shape[0]
    if chunk_size is None:
        chunk_size = _default_chunk_size(rows, vocab, hidden.element_size())
    else:
        chunk_size = _check_int("chunk_size", chunk_size, 1)
    flat_hidden = flat_hidden.contiguous()
    weight = lm_head_weight.contiguous()
    grad_wanted = torch.is_grad_enabled() and (
        hidden.requires_grad
        or lm_head_weight.requires_grad
        or (lm_head_bias is not None and lm_head_bias.requires_grad)
    )
    if not grad_wanted:
        loss, metrics, entropy, *_ = _hidden_loss_forward(
            flat_hidden, weight, lm_head_bias, flat_ids, advantages, completion_mask, options, temperature,
            chunk_size, (False, False, False),
        )  # fmt: skip
    elif torch.compiler.is_compiling():
        loss, metrics, entropy, *_ = torch.ops.grpo_ext.grpo_loss_from_hidden(flat_hidden, weight, lm_head_bias, flat_ids,
                                                               advantages, completion_mask, *options, temperature,
                                                               chunk_size)  # fmt: skip
    else:
        loss, metrics, entropy = _HiddenLossFunction.apply(
            flat_hidden, weight, lm_head_bias, flat_ids, advantages, completion_mask, options, temperature, chunk_size
        )
    return GRPOLossOutput(loss, _metrics_dict(metrics, entropy, options))
