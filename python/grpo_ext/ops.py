"""Typed, documented wrappers of the native ops, with their fake (meta) and autograd registrations.

Each public function validates its options, calls ``torch.ops.grpo_ext.<op>`` (a hand-written CPU or CUDA kernel)
and returns the same NamedTuples as :mod:`grpo_ext.reference`. The math is ``spec/grpo-math.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .reference import (
    GroupAdvantages,
    GRPOLossOutput,
    SelectiveLogSoftmax,
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
    return SelectiveLogSoftmax(
        logps.reshape(lead_shape), entropy.reshape(lead_shape) if return_entropy else None
    )


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
# grpo_loss_from_logits
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
    """GRPO loss from logits: :func:`selective_log_softmax` then :func:`grpo_loss` (spec sections 2-7).

    This version composes the two kernels: the logits are read once in the forward and once more in the backward
    (where the gradient is written), and no ``[N, V]`` temporary is made. The single-pass fused kernel of issue 3
    (gradient written during the forward) is not done yet.

    Args:
        logits: ``[B, T, V]`` float32/bfloat16/float16; ``logits[i, t]`` scores ``completion_ids[i, t]``.
        completion_ids: ``[B, T]`` int64.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]`` bool/int/float.
        temperature: ``z = logits / temperature``, > 0.
        **loss_kwargs: every keyword of :func:`grpo_loss`, with the same meaning.

    Returns:
        GRPOLossOutput: as :func:`grpo_loss`, with ``metrics["entropy"]`` the masked mean entropy.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    selected = selective_log_softmax(logits, completion_ids, temperature=temperature, return_entropy=True)
    out = grpo_loss(selected.logps, advantages, completion_mask, **loss_kwargs)
    mask = completion_mask.to(selected.entropy.dtype)
    sample_mask = loss_kwargs.get("sample_mask")
    if sample_mask is not None:
        mask = mask * sample_mask.to(mask.dtype).unsqueeze(1)
    entropy = torch.where(mask != 0, selected.entropy.detach(), 0.0)
    out.metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return out
