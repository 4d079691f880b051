"""grpo_loss_from_logits: the fused GRPO loss from logits (docs/math.md sections 2-7).

One pass per logits row computes the log-prob, the entropy and d loss / d logp and writes the row's gradient during
the forward. The op ``torch.ops.grpo_ext.grpo_loss_from_logits`` (and ``grpo_loss_from_logits_``, in place) is the
whole forward in one call: composed in csrc/plan/logits_loss.h from the pass (kernels in
csrc/cuda/grpo_loss_from_logits*.cuh and csrc/cpu/grpo_loss_from_logits.cpp, planning in
csrc/plan/grpo_loss_from_logits.h), grpo_loss' forward and the mean entropy (csrc/cuda/kept_entropy.cuh). The pass
alone is ``grpo_loss_from_logits_pass`` (and ``_pass_``), which grpo_loss_from_hidden runs over chunks of rows;
``scale_grad_`` is the backward. Here: the typed wrapper, the fakes, the eager autograd and the autograd that
torch.compile uses. The helpers here are shared with grpo_loss_from_hidden."""

from __future__ import annotations

import torch
from torch import Tensor

from ..results import GRPOLossOutput, GRPOLossTokenOutput
from ..validation.logits import check_ids_and_mask, check_rows_as_mask, check_rows_disjoint
from ..validation.loss import resolve_fused_loss_args
from ..validation.options import LogitOptions, LossOptions, takes_loss_options
from ..validation.values import check_bool, check_finite, validate_logit_options
from ._common import (
    accumulate_dtype,
    below_autograd,
    refuse_double_backward,
    refuse_forward_mode,
    refuse_function_transforms,
)
from .metrics import NUM_METRICS, metrics_dict


def resolve_loss_options(
    function: str, batch: int, length: int, like: Tensor, advantages: Tensor, completion_mask: Tensor, kwargs: dict
) -> LossOptions:
    """The loss options of a fused call, checked by grpo_loss' own validation and resolved.

    The log-probs are computed by the call itself: grpo_loss' checks see them as a ``[B, T]`` stand-in, so that they
    name every other argument (:func:`~grpo_ext.validation.loss.resolve_fused_loss_args`).
    """
    return resolve_fused_loss_args(function, batch, length, like, advantages, completion_mask, kwargs)[0]


def masked_mean_entropy(entropy: Tensor, completion_mask: Tensor, sample_mask: Tensor | None,
                        weights: Tensor | None = None) -> Tensor:  # fmt: skip
    """Mean entropy over the kept tokens, each weighted by ``weights`` when given (the kernels write 0 for masked
    rows, which are never read)."""
    mask = _in_dtype(completion_mask, entropy.dtype)
    if sample_mask is not None:
        mask = mask * _in_dtype(sample_mask, entropy.dtype).unsqueeze(1)
    if weights is not None:
        mask = mask * _in_dtype(weights, entropy.dtype)
    # an integer or bool mask multiplies as its values converted: the same products, one conversion less
    return (entropy.view_as(mask) * mask).sum() / mask.sum(dtype=entropy.dtype).clamp_min_(1.0)


def _in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a factor of a ``dtype`` product: converted when floating (so that no other float type promotes the
    product), as it is when integer or bool (a ``dtype`` tensor times it is ``dtype``, the same values)."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def with_entropy_bonus(loss: Tensor, entropy: Tensor, entropy_mean: Tensor, completion_mask: Tensor,
                       options: LossOptions, entropy_coef: float,
                       entropy_weights: Tensor | None) -> Tensor:  # fmt: skip
    """``loss - entropy_coef * loss_scale * H`` (docs/math.md section 5, "Entropy bonus"), ``H`` the mean of the
    ``[N]`` ``entropy`` over the kept tokens weighted by ``entropy_weights`` (``entropy_mean`` without weights);
    ``loss`` itself when ``entropy_coef`` is 0. The passes wrote the bonus' gradient already."""
    if entropy_coef == 0.0:
        return loss
    if entropy_weights is not None:
        entropy_mean = masked_mean_entropy(entropy, completion_mask, options.sample_mask, entropy_weights)
    scale = options.loss_scale
    if isinstance(scale, Tensor):
        scale = scale.detach().to(device=loss.device, dtype=loss.dtype)
    return loss - (entropy_coef * scale) * entropy_mean.to(loss.dtype)


def check_entropy_weights(entropy_weights: Tensor | None, completion_mask: Tensor) -> Tensor | None:
    """``entropy_weights`` checked: None, or a bool/floating ``[B, T]`` tensor on ``completion_mask``'s device."""
    if entropy_weights is None:
        return None
    if not isinstance(entropy_weights, Tensor) or not (entropy_weights.is_floating_point()
                                                       or entropy_weights.dtype == torch.bool):  # fmt: skip
        raise ValueError(f"entropy_weights must be None or a bool/floating [B, T] tensor, got "
                         f"{getattr(entropy_weights, 'dtype', type(entropy_weights).__name__)}")  # fmt: skip
    if entropy_weights.shape != completion_mask.shape or entropy_weights.device != completion_mask.device:
        raise ValueError(f"entropy_weights must have completion_mask's shape {tuple(completion_mask.shape)} and device "
                         f"{completion_mask.device}, got {tuple(entropy_weights.shape)} on {entropy_weights.device}")
    return entropy_weights.detach()


def _logits_loss_forward(
    logits: Tensor,
    ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    options: LossOptions,
    logit: LogitOptions,
    compute_grad: bool,
    inplace: bool,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    option_args: tuple | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """The fused forward on ``[N, V]``/``[B, T, V]`` logits: (loss, metrics vector, mean entropy, d loss/d logits,
    ``[N]`` log-probs, ``[N]`` entropy). ``option_args``: ``options.op_args()`` when the caller has them already.

    One native op call (csrc/plan/logits_loss.h): the pass over the logits (log-probs, entropy and, token-level, the
    gradient; sequence level and vespo take a second pass with the loss' d loss / d logp), the loss of its log-probs,
    the mean entropy over the kept tokens and the entropy bonus. In place, the gradient is written over ``logits``
    (returned as the gradient).
    """
    args = (logits, ids, advantages, completion_mask, *(options.op_args() if option_args is None else option_args),
            *logit.op_args(), entropy_coef, entropy_weights, compute_grad)  # fmt: skip
    op = _LOGITS_LOSS_INPLACE if inplace else _LOGITS_LOSS
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        out = op(*args)
    else:
        with below_autograd():  # grad mode is off: past the autograd key, as its registration would hand the op on
            out = op(*args)
    if inplace:
        loss, metrics, entropy_mean, logps, entropy = out
        return loss, metrics, entropy_mean, logits if compute_grad else None, logps, entropy
    loss, metrics, entropy_mean, grad, logps, entropy = out
    return loss, metrics, entropy_mean, grad if compute_grad else None, logps, entropy


_LOGITS_LOSS = torch.ops.grpo_ext.grpo_loss_from_logits.default
_LOGITS_LOSS_INPLACE = torch.ops.grpo_ext.grpo_loss_from_logits_.default


_ID_DTYPES = (torch.int64, torch.int32)


def check_logits_shapes(logits: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Checks the logits/ids/mask shapes; returns the ids as the op takes them: ``[N]``, or the ``[B, T]`` ids
    themselves when contiguous (the op views them as ``[N]``: no reshape call here)."""
    if isinstance(logits, Tensor) and isinstance(completion_ids, Tensor) and isinstance(completion_mask, Tensor):
        # the usual call ([B, T, V] logits, [B, T] ids and mask) vouched for at once; any other takes the checks below
        # (the mask's device is left to the loss options' checks, which name it; a Size sliced costs a call)
        shape, mask_shape = logits.shape, completion_mask.shape
        if (len(shape) == 3 and len(mask_shape) == 2 and shape[0] == mask_shape[0] and shape[1] == mask_shape[1]
                and shape[2] >= 1 and logits.is_floating_point() and completion_ids.shape == mask_shape
                and completion_ids.dtype in _ID_DTYPES and completion_ids.device == logits.device):  # fmt: skip
            return completion_ids if completion_ids.is_contiguous() else completion_ids.reshape(-1)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape [B, T, V] or [N, V], got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least one entry (V >= 1)")
    check_rows_as_mask("logits", logits, completion_mask)
    rows = logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]
    return check_ids_and_mask(rows, logits.device, completion_ids, completion_mask)


_SCALE_GRAD = torch.ops.grpo_ext.scale_grad_.default


def scale_grad(grad: Tensor, grad_loss: Tensor) -> Tensor:
    """``grad *= grad_loss`` in place; a no-op on the device when grad_loss == 1 (no host sync, no memory pass)."""
    _SCALE_GRAD(grad.view(1, -1) if grad.dim() == 1 else grad, grad_loss)
    return grad


def take_saved_grads(ctx, function: str) -> tuple:
    """The gradients the forward computed and kept on ``ctx``, handed over once (a second backward raises)."""
    grads = ctx.saved_grads
    if grads is None:
        raise RuntimeError(
            f"{function}: backward ran twice through the same forward; its gradients were computed in the forward "
            "and handed over in the first backward (retain_graph=True is not supported). Run the forward again."
        )
    ctx.saved_grads = None  # handed over: the buffers are scaled in place and given to autograd
    return grads


def _logits_rows(logits: Tensor) -> int:
    return logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]


@torch.library.register_fake("grpo_ext::grpo_loss_from_logits_pass")
def _grpo_loss_from_logits_pass_fake(logits, *args):
    compute_grad = args[-1]
    rows, dtype = _logits_rows(logits), accumulate_dtype(logits.dtype)
    grad_shape = (rows, logits.shape[-1]) if compute_grad else (0,)
    return logits.new_empty((rows,), dtype=dtype), logits.new_empty((rows,), dtype=dtype), logits.new_empty(grad_shape)


@torch.library.register_fake("grpo_ext::grpo_loss_from_logits_pass_")
def _grpo_loss_from_logits_pass_inplace_fake(logits, *args):
    rows, dtype = _logits_rows(logits), accumulate_dtype(logits.dtype)
    return logits.new_empty((rows,), dtype=dtype), logits.new_empty((rows,), dtype=dtype)


@torch.library.register_fake("grpo_ext::scale_grad_")
def _scale_grad_fake(grad, factor):
    return None


class _LogitsLossFunction(torch.autograd.Function):
    """Eager autograd for the fused logits loss: the gradient is computed in the forward and kept on ``ctx``.

    It is kept as a plain attribute, not with save_for_backward: in the in-place mode it is the logits' own
    storage, whose version counter the forward bumps on purpose. The loss is the only output; the forward's other
    results, none differentiable, are appended to ``detached`` (a list) instead of going through autograd's output
    bookkeeping: they come out as they would marked non-differentiable, plain tensors without a ``grad_fn``.
    """

    @staticmethod
    def forward(ctx, logits, ids, advantages, completion_mask, options, logit, inplace, entropy_coef, entropy_weights,
                option_args, detached):  # fmt: skip
        loss, metrics, entropy, grad, token_logps, token_entropy = _logits_loss_forward(
            logits, ids, advantages, completion_mask, options, logit, True, inplace, entropy_coef, entropy_weights,
            option_args,
        )  # fmt: skip
        ctx.saved_grads = (grad,)
        detached += (metrics, entropy, token_logps, token_entropy)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("grpo_loss_from_logits")
        (grad,) = take_saved_grads(ctx, "grpo_loss_from_logits")
        return scale_grad(grad, grad_loss), None, None, None, None, None, None, None, None, None, None


def logit_options_from_op_args(temperature: float, logit_scale: float, logit_softcap: float) -> LogitOptions:
    """The LogitOptions of a composite op's ``(temperature, logit_scale, logit_softcap)`` arguments (0: no cap)."""
    return LogitOptions(temperature, logit_scale, logit_softcap if logit_softcap > 0 else None)


@torch.library.register_fake("grpo_ext::grpo_loss_from_logits")
def _grpo_loss_from_logits_fake(logits, ids, advantages, completion_mask, *args):
    compute_grad = args[-1]
    dtype = accumulate_dtype(logits.dtype)
    rows = _logits_rows(logits)
    return (
        logits.new_empty((), dtype=dtype),
        logits.new_empty((NUM_METRICS,), dtype=dtype),
        logits.new_empty((), dtype=dtype),
        logits.new_empty(logits.shape if compute_grad else (0,)),
        logits.new_empty((rows,), dtype=dtype),
        logits.new_empty((rows,), dtype=dtype),
    )


@torch.library.register_fake("grpo_ext::grpo_loss_from_logits_")
def _grpo_loss_from_logits_inplace_fake(logits, ids, advantages, completion_mask, *args):
    # the functional op's outputs without the gradient (written over the logits)
    loss, metrics, entropy_mean, _, logps, entropy = _grpo_loss_from_logits_fake(
        logits, ids, advantages, completion_mask, *args[:-1], False
    )
    return loss, metrics, entropy_mean, logps, entropy


def _logits_op_setup_context(ctx, inputs, output) -> None:
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(output[3])
    # compute_grad=False (the last input): no gradient was written, so the loss is not differentiable either
    ctx.mark_non_differentiable(*(output[1:] if inputs[-1] else output))


def _logits_op_backward(ctx, grad_loss, *unused):
    refuse_double_backward("grpo_loss_from_logits")
    (grad,) = ctx.saved_tensors
    return (grad * grad_loss.to(grad.dtype),) + (None,) * (ctx.num_inputs - 1)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_from_logits", _logits_op_backward, setup_context=_logits_op_setup_context
)


@takes_loss_options
def grpo_loss_from_logits(
    logits: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    inplace_grad: bool = False,
    return_token_logps: bool = False,
    **options,
) -> GRPOLossOutput | GRPOLossTokenOutput:
    """Fused GRPO loss from logits: log-probs, entropy, loss, metrics and d loss / d logits (docs/math.md sections 2-7).

    Token-level losses read each logits row once for its softmax statistics and write its gradient in the same
    kernel; no ``[N, V]`` float temporary is made. On CUDA each row is read a second time to write its gradient
    (from L2 where it is still there), by blocks of 256 threads (512 for float32 logits): on an H100 and an H200 that
    was faster than staging the row on chip to read it once (``GRPO_EXT_LOGITS_SINGLE_READ=1``: the row split over a
    thread-block cluster of up to 16 blocks of 256 threads on sm_90). ``GRPO_EXT_LOGITS_THREADS=128|256|512|1024``
    and ``GRPO_EXT_LOGITS_PERSISTENT=1`` pick the other layouts of the pass on the SM (benchmarks/NOTES.md), all read
    at each call so that one run compares them (``benchmarks/bench_floor.py``). Sequence-level
    losses (GSPO) take a second pass, since a row's ratio needs all its log-probs first. Masked rows are never read
    and get a zero gradient. The backward only scales the gradient by the incoming one (skipped when it is 1).

    Args:
        logits: ``[B, T, V]`` (rows may be strided, e.g. ``model_logits[:, :-1]``; V contiguous) or ``[N, V]`` with
            ``N = B * T``, float32/bfloat16/float16 (or float64); ``logits[i, t]`` scores ``completion_ids[i, t]``.
        completion_ids: ``[B, T]`` (or ``[N]``) int64 token ids in ``[0, V)``.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]`` bool/int/float.
        temperature: ``z = y / temperature``, > 0 (``y``: the scaled, soft-capped logits; docs/math.md section 2).
        logit_scale: ``y = logit_scale * logits`` first (Cohere's ``logit_scale``); finite, > 0.
        logit_softcap: then ``y = logit_softcap * tanh(y / logit_softcap)`` (Gemma 2's final soft-capping), or None.
            The gradient is with respect to the raw ``logits``.
        entropy_coef: the entropy bonus (TRL's ``entropy_coef``): ``loss - entropy_coef * loss_scale * H``, ``H`` the
            mean entropy over the kept tokens (``metrics["entropy"]``) of the distribution the loss uses; its
            gradient is written by the same pass (docs/math.md section 5, "Entropy bonus"). Finite; 0: none.
        entropy_weights: ``[B, T]`` bool/float weights of the kept tokens in the bonus' mean (TRL's high-entropy
            mask with ``top_entropy_quantile``), not differentiated; None: every kept token (``metrics["entropy"]``
            stays the unweighted mean).
        inplace_grad: write the gradient over ``logits`` instead of a new buffer (no extra memory). ``logits`` must
            be the output of an op (a model's lm_head, say), not a leaf; its version counter is bumped, so autograd
            raises if anything saved it for backward, and its values are the gradient afterwards. Eager mode only.
        return_token_logps: also return the ``[B, T]`` log-probs and entropies the pass computed (detached), as a
            :class:`~grpo_ext.GRPOLossTokenOutput`: no second pass over the logits for per-token metrics.
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there).

    Returns:
        GRPOLossOutput: as :func:`grpo_loss` (``loss`` float32, with autograd to ``logits``), with
        ``metrics["entropy"]`` the mean entropy over the kept tokens; a GRPOLossTokenOutput with
        ``return_token_logps=True``.
    """
    flat_ids = check_logits_shapes(logits, completion_ids, completion_mask)
    refuse_forward_mode("grpo_loss_from_logits", logits)
    logit = validate_logit_options(temperature, logit_scale, logit_softcap)
    if entropy_coef.__class__ is not float or entropy_coef != 0.0:  # 0.0: the default, finite
        entropy_coef = check_finite("entropy_coef", entropy_coef)
    return_token_logps = check_bool("return_token_logps", return_token_logps)
    inplace_grad = check_bool("inplace_grad", inplace_grad)
    if entropy_weights is not None:
        entropy_weights = check_entropy_weights(entropy_weights, completion_mask)
    batch, length = completion_mask.shape
    resolved, option_args = resolve_fused_loss_args("grpo_loss_from_logits", batch, length, logits, advantages,
                                                    completion_mask, options)  # fmt: skip
    if not logits.is_contiguous() and logits.stride(-1) != 1 and logits.shape[-1] > 1:
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
        if compute_grad:
            check_rows_disjoint("inplace_grad=True", logits)
    if not compute_grad:
        loss, metrics, entropy, _, token_logps, token_entropy = _logits_loss_forward(
            logits, flat_ids, advantages, completion_mask, resolved, logit, False, False, entropy_coef,
            entropy_weights, option_args,
        )  # fmt: skip
    elif torch.compiler.is_compiling():
        loss, metrics, entropy, _, token_logps, token_entropy = _LOGITS_LOSS(
            logits, flat_ids, advantages, completion_mask, *option_args, *logit.op_args(), entropy_coef,
            entropy_weights, True,
        )  # fmt: skip
    else:
        refuse_function_transforms("grpo_loss_from_logits")
        detached: list[Tensor] = []
        loss = _LogitsLossFunction.apply(logits, flat_ids, advantages, completion_mask, resolved, logit, inplace_grad,
                                         entropy_coef, entropy_weights, option_args, detached)  # fmt: skip
        metrics, entropy, token_logps, token_entropy = detached
        if inplace_grad:
            # the values are the gradient now: anything that saved the logits for backward must fail loudly
            torch.autograd.graph.increment_version(logits)
    return loss_output(loss, metrics_dict(metrics, resolved, entropy), token_logps, token_entropy, completion_mask,
                       return_token_logps)  # fmt: skip


def loss_output(loss: Tensor, metrics: dict[str, Tensor], token_logps: Tensor, token_entropy: Tensor,
                completion_mask: Tensor, with_tokens: bool) -> GRPOLossOutput | GRPOLossTokenOutput:  # fmt: skip
    """The public output of a fused loss: :class:`GRPOLossOutput`, or with ``with_tokens`` also the ``[N]``
    per-token values viewed as ``[B, T]`` (the kernels wrote 0 for the rows they never read)."""
    if not with_tokens:
        return GRPOLossOutput(loss, metrics)
    return GRPOLossTokenOutput(loss, metrics, token_logps.detach().view_as(completion_mask),
                               token_entropy.detach().view_as(completion_mask))
