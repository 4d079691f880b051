"""grpo_loss_from_hidden: the fused GRPO loss from the last hidden states, never materializing the [N, V] logits.

Chunks of token rows go through the LM head (torch, cuBLAS on CUDA; ``lm_head.py``) and the fused logits pass of
grpo_loss_from_logits in place; the gradients for the hidden states, the weight and the bias are formed chunk by
chunk in the forward. No kernel of its own: the native ops are grpo_loss_from_logits' and grpo_loss's. Here: the
typed wrapper, the eager autograd and the composite op ``grpo_ext::grpo_loss_from_hidden`` for torch.compile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _native
from ..results import GRPOLossOutput, GRPOLossTokenOutput
from ..validation import (
    check_bool,
    check_compute_dtype,
    check_finite,
    check_ids_and_mask,
    check_int,
    check_rows_as_mask,
    validate_logit_options,
)
from ..validation.hidden import RefHead, check_lm_head, check_ref_head
from ..validation.options import LogitOptions, LossOptions, takes_loss_options
from ._common import accumulate_dtype, refuse_double_backward, refuse_forward_mode, refuse_function_transforms
from .grpo_loss_from_logits import (
    check_entropy_weights,
    logit_options_from_op_args,
    loss_output,
    masked_mean_entropy,
    resolve_loss_options,
    scale_grad,
    take_saved_grads,
    with_entropy_bonus,
)
from .kept_rows import Segment, chunk_segments, plan_rows, put_rows, take_rows, zero_outside
from .lm_head import (  # default_chunk_size and one_chunk_rows: importable from here as before
    accumulate_product,
    default_chunk_size,  # noqa: F401
    head_chunking,
    one_chunk_rows,  # noqa: F401
    product,
    project,
    shared_weight_gradient,
    widen_in_place,
)
from .metrics import NUM_METRICS, metrics_dict
from .selective_log_softmax import selective_log_softmax

#: Runs of kept rows that get their own slice of a chunk, at most: beyond, the shortest gaps between runs are
#: bridged (their masked rows go through the GEMMs, zeroed as the kept rows' neighbours), so a scattered mask costs
#: at most this many pass calls and copies per call, not one per run.
MAX_SEGMENTS = 128

#: Whether the chunks hold the kept rows only (True) or every row, masked ones included (False: the path before
#: gathering). Tests switch it off to show the gathered results equal the ungathered ones bit for bit.
_GATHER_KEPT_ROWS = True


@torch.no_grad()
def _write_ref_logps(ref_head: RefHead, pieces: list[Segment], ids: Tensor, logit: LogitOptions, out: Tensor) -> None:
    """``out`` at the pieces' rows = the reference head's log-probs of ``ids`` (the pieces' ids, in order): one chunk
    of logits, no grad."""
    ref_hidden, ref_weight, ref_bias = ref_head
    logits = project(take_rows(ref_hidden, pieces), ref_weight, ref_bias)
    put_rows(out, pieces, selective_log_softmax(logits, ids, **logit._asdict()).logps)


def _hidden_loss_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    options: LossOptions,
    logit: LogitOptions,
    chunk_size: int,
    needs: tuple[bool, bool, bool],
    ref_head: RefHead | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    one_chunk: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor]:
    """The chunked forward: (loss, metrics vector, mean entropy, d/d hidden, d/d weight, d/d bias, ``[N]`` log-probs,
    ``[N]`` entropy).

    Only the kept rows (``completion_mask * sample_mask != 0``) go through the LM head: their runs are read on the
    host (one device sync) and cut into chunks of ``chunk_size`` rows. Per chunk: logits = hidden @ weight.T (+ bias)
    through torch (cuBLAS) on the chunk's rows, the fused logits kernel in place on each run's slice (a pass reads
    the ``[B, T]`` loss inputs at the run's own rows, so the normalizers and per-row inputs are the whole problem's),
    then grad_hidden = g @ weight scattered back to the run's rows and grad_weight += g.T @ hidden (float32
    accumulator). The other rows get log-prob, entropy and hidden gradient 0. Sequence-level losses first run every
    chunk for the log-probs alone, then recompute each chunk's logits for the gradient (the entropy bonus' gradient
    is written with the policy term's, by the pass that writes the gradient). With ``ref_head``, each chunk first
    writes its reference log-probs into ``options.ref_logps`` (the rows the chunk's pass then reads), no_grad.
    ``weight`` may have another dtype than ``hidden`` (a master weight: the GEMMs run in ``hidden``'s dtype, its
    gradient comes back in its own).
    """
    batch, length = completion_mask.shape
    rows, vocab = hidden.shape[0], weight.shape[0]
    master_weight = weight
    need_hidden, need_weight, need_bias = needs
    compute_grad = any(needs)
    acc = accumulate_dtype(hidden.dtype)
    # Rows that are never read get a zero gradient, whatever the other operand holds: their hidden states (NaN,
    # maybe) must not enter g.T @ hidden, and a non-finite weight makes their rows of g @ weight NaN (0 * NaN).
    kept = completion_mask != 0
    if options.sample_mask is not None:
        kept = kept & (options.sample_mask != 0).unsqueeze(1)
    kept = kept.reshape(rows)
    plan = plan_rows(kept, _GATHER_KEPT_ROWS, MAX_SEGMENTS)
    kept_rows = sum(end - start for start, end in plan.segments)
    if 0 < kept_rows <= one_chunk:  # the default's one chunk, on the rows kept (lm_head.head_chunking)
        chunk_size = kept_rows
    chunks = chunk_segments(plan.segments, chunk_size)
    logps = torch.empty(rows, dtype=acc, device=hidden.device)
    entropy = torch.empty(rows, dtype=acc, device=hidden.device)
    zero_outside(logps, plan.segments)
    zero_outside(entropy, plan.segments)
    grad_hidden = None
    if need_hidden:
        grad_hidden = torch.empty_like(hidden)
        zero_outside(grad_hidden, plan.segments)
    # d/d weight: written by the first chunk (no zero fill of [V, H]), accumulated in float32 by the others; when one
    # chunk covers every scored row it is that chunk's product in the compute dtype (no accumulator).
    grad_weight = None
    weight_grad_dtype = hidden.dtype if len(chunks) <= 1 else acc
    # A master weight (float32 under bf16 GEMMs): cast here, inside its gradient's buffer when one chunk and the
    # widths allow (lm_head.SharedWeightGradient), so that no [V, H] temporary is allocated (and faulted in) for it.
    shared = None
    if weight.dtype != hidden.dtype:
        if need_weight and len(chunks) == 1:
            shared = shared_weight_gradient(weight, hidden.dtype)
        weight = weight.to(hidden.dtype) if shared is None else shared.cast
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    ops = torch.ops.grpo_ext
    option_args = options.op_args()
    logit_args = logit.op_args()

    def run_passes(logits: Tensor, pieces: list[Segment], chunk_ids: Tensor, token_grad: Tensor | None,
                   grad_now: bool) -> None:  # fmt: skip
        """The fused pass over each piece's slice of the chunk's logits, at the piece's own [B, T] rows."""
        op = ops.grpo_loss_from_logits_pass_ if grad_now else ops.grpo_loss_from_logits_pass
        offset = 0
        for start, end in pieces:
            part = slice(offset, offset + end - start)
            out = op(logits[part], chunk_ids[part], start, advantages, completion_mask,
                     None if token_grad is None else token_grad[start:end], *option_args, *logit_args,
                     entropy_coef if grad_now else 0.0, entropy_weights, grad_now)  # fmt: skip
            logps[start:end] = out[0]
            entropy[start:end] = out[1]
            offset = part.stop

    def backward_through_chunk(pieces: list[Segment], chunk_hidden: Tensor, grad_logits: Tensor) -> None:
        nonlocal grad_weight
        chunk_kept = take_rows(kept, pieces).unsqueeze(1) if plan.bridged else None
        if need_hidden:
            # masked rows among the chunk's are zeroed afterwards, a pass over the chunk's [n, H] rows
            if len(pieces) == 1:
                start, end = pieces[0]
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
                if chunk_kept is not None:
                    grad_hidden[start:end].masked_fill_(~chunk_kept, 0.0)
            else:
                part = torch.mm(grad_logits, weight)
                if chunk_kept is not None:
                    part.masked_fill_(~chunk_kept, 0.0)
                put_rows(grad_hidden, pieces, part)
        if need_weight:
            read = chunk_hidden if chunk_kept is None else torch.where(chunk_kept, chunk_hidden, 0.0)
            if shared is not None:  # the one chunk: its product in the buffer's second half, widened at the end
                grad_weight = torch.mm(grad_logits.t(), read, out=shared.product)
            elif grad_weight is None:
                grad_weight = product(grad_logits.t(), read, weight_grad_dtype)
            else:
                accumulate_product(grad_weight, grad_logits.t(), read)
        if need_bias:
            grad_bias.add_(grad_logits.sum(0, dtype=acc))

    token_level = not options.gradient_needs_whole_rows
    two_phase = compute_grad and not token_level
    grad_now = compute_grad and token_level
    for pieces in chunks:
        chunk_ids = take_rows(ids, pieces)
        if ref_head is not None:
            _write_ref_logps(ref_head, pieces, chunk_ids, logit, options.ref_logps.view(-1))
        chunk_hidden = take_rows(hidden, pieces)
        logits = project(chunk_hidden, weight, bias)
        run_passes(logits, pieces, chunk_ids, None, grad_now)
        if grad_now:
            backward_through_chunk(pieces, chunk_hidden, logits)  # the logits buffer holds the gradient now
        # freed before the next chunk's are made: rebinding would keep two chunks of logits alive at its projection
        del logits, chunk_hidden
    loss, metrics, grad_raw, grad_scale = ops.grpo_loss_forward(
        logps.view(batch, length), advantages, completion_mask, *option_args, two_phase
    )
    if two_phase:
        token_grad = (grad_raw * grad_scale).reshape(-1)
        for pieces in chunks:
            chunk_hidden = take_rows(hidden, pieces)
            logits = project(chunk_hidden, weight, bias)
            run_passes(logits, pieces, take_rows(ids, pieces), token_grad, True)
            backward_through_chunk(pieces, chunk_hidden, logits)
            del logits, chunk_hidden  # as above
    if shared is not None:
        grad_weight = widen_in_place(shared)
    if need_weight and grad_weight is None:  # no row at all
        grad_weight = torch.zeros_like(master_weight)
    if grad_weight is not None and grad_weight.dtype != master_weight.dtype:
        grad_weight = grad_weight.to(master_weight.dtype)
    if grad_bias is not None and bias is not None and grad_bias.dtype != bias.dtype:
        grad_bias = grad_bias.to(bias.dtype)
    entropy_mean = masked_mean_entropy(entropy, completion_mask, options.sample_mask)
    loss = with_entropy_bonus(loss, entropy, entropy_mean, completion_mask, options, entropy_coef, entropy_weights)
    return loss, metrics, entropy_mean, grad_hidden, grad_weight, grad_bias, logps, entropy


class _HiddenLossFunction(torch.autograd.Function):
    """Eager autograd for the chunked hidden-state loss: gradients computed in the forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, advantages, completion_mask, options, logit, chunk_size,
                ref_head=None, entropy_coef=0.0, entropy_weights=None, one_chunk=0):  # fmt: skip
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, metrics, entropy, *grads, token_logps, token_entropy = _hidden_loss_forward(
            hidden, weight, bias, ids, advantages, completion_mask, options, logit, chunk_size, needs, ref_head,
            entropy_coef, entropy_weights, one_chunk,
        )  # fmt: skip
        ctx.saved_grads = tuple(grads)
        ctx.mark_non_differentiable(metrics, entropy, token_logps, token_entropy)
        return loss, metrics, entropy, token_logps, token_entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        refuse_double_backward("grpo_loss_from_hidden")
        grads = take_saved_grads(ctx, "grpo_loss_from_hidden")
        scaled = tuple(None if g is None else scale_grad(g, grad_loss) for g in grads)
        return scaled + (None,) * 10


# The chunked loss as one opaque op for torch.compile; every gradient computed (bias' empty without bias).
torch.library.define(
    "grpo_ext::grpo_loss_from_hidden",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor ids, Tensor advantages, Tensor completion_mask, "
    f"{_native.LOSS_OPTIONS_SCHEMA}float temperature, float logit_scale, float logit_softcap, int chunk_size, "
    "float entropy_coef, Tensor? entropy_weights, int one_chunk) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("grpo_ext::grpo_loss_from_hidden", "CompositeExplicitAutograd")
def _grpo_loss_from_hidden_impl(hidden, weight, bias, ids, advantages, completion_mask, *rest):
    *options, temperature, logit_scale, logit_softcap, chunk_size, entropy_coef, entropy_weights, one_chunk = rest
    logit = logit_options_from_op_args(temperature, logit_scale, logit_softcap)
    loss, metrics, entropy, grad_hidden, grad_weight, grad_bias, token_logps, token_entropy = _hidden_loss_forward(
        hidden, weight, bias, ids, advantages, completion_mask, LossOptions.from_op_args(tuple(options)), logit,
        chunk_size, (True, True, bias is not None), None, entropy_coef, entropy_weights, one_chunk,
    )  # fmt: skip
    if grad_bias is None:
        grad_bias = weight.new_empty((0,))
    return loss, metrics, entropy, grad_hidden, grad_weight, grad_bias, token_logps, token_entropy


@torch.library.register_fake("grpo_ext::grpo_loss_from_hidden")
def _grpo_loss_from_hidden_fake(hidden, weight, bias, *args):
    dtype = accumulate_dtype(hidden.dtype)
    return (
        hidden.new_empty((), dtype=dtype),
        hidden.new_empty((NUM_METRICS,), dtype=dtype),
        hidden.new_empty((), dtype=dtype),
        torch.empty_like(hidden),
        torch.empty_like(weight),
        torch.empty_like(bias) if bias is not None else weight.new_empty((0,)),
        hidden.new_empty((hidden.shape[0],), dtype=dtype),
        hidden.new_empty((hidden.shape[0],), dtype=dtype),
    )


def _hidden_op_setup_context(ctx, inputs, output) -> None:
    ctx.num_inputs = len(inputs)
    ctx.has_bias = inputs[2] is not None
    ctx.save_for_backward(*output[3:6])
    ctx.mark_non_differentiable(*output[1:])


def _hidden_op_backward(ctx, grad_loss, *unused):
    refuse_double_backward("grpo_loss_from_hidden")
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    scale = grad_loss.to(grad_hidden.dtype)
    grads = (grad_hidden * scale, grad_weight * scale, grad_bias * scale if ctx.has_bias else None)
    return grads + (None,) * (ctx.num_inputs - 3)


torch.library.register_autograd(
    "grpo_ext::grpo_loss_from_hidden", _hidden_op_backward, setup_context=_hidden_op_setup_context
)


@takes_loss_options
def grpo_loss_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    return_token_logps: bool = False,
    **options,
) -> GRPOLossOutput | GRPOLossTokenOutput:
    """Fused GRPO loss from the last hidden states, never materializing the ``[N, V]`` logits (docs/math.md 2-7).

    Chunks over the kept tokens (``completion_mask * sample_mask != 0``): masked rows cost no GEMM work (gathered
    out before the LM head; their log-prob, entropy and hidden-state gradient are exactly 0), so a batch with half
    its tokens padded takes about half the time. Each chunk's logits (``chunk_size x V``) go through the fused
    logits kernel in place, and the gradients for ``hidden``, ``lm_head_weight`` and ``lm_head_bias`` are formed
    chunk by chunk (the weight and bias ones accumulated in float32), all in the forward; the backward only scales
    them by the incoming gradient (skipped when it is 1). Peak extra memory: the gradients plus one chunk of logits.
    The loss, its normalizers (the mask's sum, ``num_items_in_batch``, ``max_completion_length``, the rows'
    lengths) and every per-token and per-row input are read in the ``[B, T]`` layout, as without gathering.

    Host sync: one per call (the kept rows' positions are read on the host to size the GEMMs); this composite op
    has its own chunk loop anyway, so it is not CUDA-graph capturable.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]`` (``N = B * T``) float32/bfloat16/float16: the hidden states that score
            ``completion_ids`` (positions already aligned).
        lm_head_weight: ``[V, H]``, same dtype as ``hidden`` unless ``compute_dtype`` is given.
        completion_ids: ``[B, T]`` (or ``[N]``) int64 ids in ``[0, V)``.
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        completion_mask: ``[B, T]`` bool/int/float.
        lm_head_bias: ``[V]`` or None.
        temperature: ``z = y / temperature``, > 0, where ``y`` is the raw logits ``x = hidden @ W.T + b`` scaled
            and soft-capped (docs/math.md section 2).
        logit_scale: ``y = logit_scale * x`` first (Cohere's ``logit_scale``); finite, > 0.
        logit_softcap: then ``y = logit_softcap * tanh(y / logit_softcap)`` (Gemma 2's final soft-capping), or None.
        entropy_coef: the entropy bonus (TRL's ``entropy_coef``): ``loss - entropy_coef * loss_scale * H``, ``H`` the
            mean entropy over the kept tokens (``metrics["entropy"]``); its gradient is written by the chunks' pass
            (docs/math.md section 5, "Entropy bonus"). Finite; 0: none.
        entropy_weights: ``[B, T]`` weights of the kept tokens in the bonus' mean, as
            :func:`grpo_loss_from_logits` takes them.
        chunk_size: kept token rows per chunk (default :func:`~grpo_ext.ops.lm_head.default_chunk_size`, the same
            rule on CPU and CUDA: the largest power of two whose logits fit in the float32 ``[V, H]`` weight
            gradient's size, which the op holds anyway, and at least in 256 MiB; e.g. 8192 rows at H=4096,
            V=151936 in bf16; and every kept row in one chunk up to :func:`~grpo_ext.ops.lm_head.one_chunk_rows`,
            where one chunk peaks no higher; under torch.compile too).
        compute_dtype: the dtype of the GEMMs and the pass (bf16 autocast's ``torch.bfloat16``, say), or None:
            ``hidden``'s, and the weight must have it. Given, ``hidden``, ``lm_head_weight`` and ``lm_head_bias`` may
            each have any floating dtype (a float32 master weight, say): the op casts them, and each gradient comes
            back in its tensor's own dtype. The numbers are those of casting first (as autocast does) and letting
            autograd cast the gradients back; the memory is less: a float32 weight under bf16 GEMMs is cast into
            its gradient's buffer, where the bf16 weight gradient is then formed and widened in place, when one
            chunk covers the kept rows (no ``[V, H]`` temporary; on the CPU, whose fresh pages cost a fault each,
            also the time of two ``[V, H]`` passes; benchmarks/NOTES.md, "A float32 master weight").
        return_token_logps: also return the ``[B, T]`` log-probs and entropies the chunks' pass computed (detached),
            as a :class:`~grpo_ext.GRPOLossTokenOutput`: per-token metrics (the clip ratio's extremes, say) need no
            second pass through the LM head.
        **options: the loss options, keywords only (:class:`~grpo_ext.ops.options.LossOptions`, each listed below
            from its definition there).

    Returns:
        GRPOLossOutput: as :func:`grpo_loss_from_logits` (``loss`` with autograd to hidden, weight and bias); a
        GRPOLossTokenOutput with ``return_token_logps=True``.
    """
    return hidden_loss(hidden, lm_head_weight, completion_ids, advantages, completion_mask, lm_head_bias=lm_head_bias,
                       temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
                       entropy_coef=entropy_coef, entropy_weights=entropy_weights, chunk_size=chunk_size,
                       compute_dtype=compute_dtype, return_token_logps=return_token_logps, **options)  # fmt: skip


def hidden_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_coef: float = 0.0,
    entropy_weights: Tensor | None = None,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    ref_head: RefHead | None = None,
    return_token_logps: bool = False,
    **options,
) -> GRPOLossOutput | GRPOLossTokenOutput:
    """:func:`grpo_loss_from_hidden`, and with ``ref_head`` the reference log-probs from a reference LM head.

    ``ref_head`` = (ref hidden ``[B, T, H']`` or ``[N, H']``, ref weight ``[V, H']``, ref bias ``[V]`` or None): each
    chunk's reference log-probs are computed under no_grad in the same chunked pass, just before the chunk's
    policy logits (docs/math.md section 2, same temperature and logits options), instead of being passed as
    ``ref_logps``.
    """
    if ref_head is not None and options.get("ref_logps") is not None:
        raise ValueError("pass either ref_logps or a reference head (ref_input/ref_weight), not both")
    compute_dtype = check_compute_dtype(compute_dtype)
    vocab = check_lm_head(hidden, lm_head_weight, lm_head_bias, compute_dtype)
    refuse_forward_mode("grpo_loss_from_hidden", hidden, lm_head_weight, lm_head_bias)
    if compute_dtype is not None:  # autograd casts the small gradients back; the weight is cast inside the op
        hidden = hidden.to(compute_dtype)
        lm_head_bias = None if lm_head_bias is None else lm_head_bias.to(compute_dtype)
        if ref_head is not None:
            ref_head = tuple(t.to(compute_dtype) if isinstance(t, Tensor) and t.is_floating_point() else t
                             for t in ref_head)  # fmt: skip
    check_rows_as_mask("hidden", hidden, completion_mask)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_ids = check_ids_and_mask(flat_hidden.shape[0], hidden.device, completion_ids, completion_mask)
    logit = validate_logit_options(temperature, logit_scale, logit_softcap)
    entropy_coef = check_finite("entropy_coef", entropy_coef)
    return_token_logps = check_bool("return_token_logps", return_token_logps)
    entropy_weights = check_entropy_weights(entropy_weights, completion_mask)
    batch, length = completion_mask.shape
    if ref_head is not None:
        ref_head = check_ref_head(ref_head, flat_hidden.shape[0], vocab, hidden, completion_mask)
        options["ref_logps"] = torch.zeros((batch, length), dtype=accumulate_dtype(hidden.dtype), device=hidden.device)
    resolved = resolve_loss_options("grpo_loss_from_hidden", batch, length, hidden, advantages, completion_mask,
                                    options)  # fmt: skip
    rows = flat_hidden.shape[0]
    one_chunk = 0  # a chunk_size given is kept as given
    if chunk_size is None:
        chunk_size, one_chunk = head_chunking(flat_hidden, lm_head_weight)
    else:
        chunk_size = check_int("chunk_size", chunk_size, 1)
    flat_hidden = flat_hidden.contiguous()
    weight = lm_head_weight.contiguous()
    grad_wanted = torch.is_grad_enabled() and (
        hidden.requires_grad
        or lm_head_weight.requires_grad
        or (lm_head_bias is not None and lm_head_bias.requires_grad)
    )
    if not grad_wanted:
        with torch.no_grad():  # an advantages that requires grad must not make a loss that asks for one
            loss, metrics, entropy, *_, token_logps, token_entropy = _hidden_loss_forward(
                flat_hidden, weight, lm_head_bias, flat_ids, advantages, completion_mask, resolved, logit,
                chunk_size, (False, False, False), ref_head, entropy_coef, entropy_weights,
            )  # fmt: skip
    elif torch.compiler.is_compiling():
        if ref_head is not None:  # the opaque op takes ref_logps: fill them first, chunk by chunk
            for start in range(0, rows, chunk_size):
                end = min(rows, start + chunk_size)
                _write_ref_logps(ref_head, [(start, end)], flat_ids[start:end], logit, resolved.ref_logps.view(-1))
        loss, metrics, entropy, *_, token_logps, token_entropy = torch.ops.grpo_ext.grpo_loss_from_hidden(
            flat_hidden, weight, lm_head_bias, flat_ids, advantages, completion_mask, *resolved.op_args(),
            *logit.op_args(), chunk_size, entropy_coef, entropy_weights, one_chunk,
        )
    else:
        refuse_function_transforms("grpo_loss_from_hidden")
        loss, metrics, entropy, token_logps, token_entropy = _HiddenLossFunction.apply(
            flat_hidden, weight, lm_head_bias, flat_ids, advantages, completion_mask, resolved, logit, chunk_size,
            ref_head, entropy_coef, entropy_weights, one_chunk,
        )
    return loss_output(loss, metrics_dict(metrics, resolved, entropy), token_logps, token_entropy, completion_mask,
                       return_token_logps)  # fmt: skip
