"""The policy loss from TRL's fused LM head: grpo_ext.grpo_loss_from_hidden inside the model's forward.

TRL's ``add_fused_lm_head`` forward (1.15 and 1.16; 1.14's ``GRPOTrainer._chunked_logps``, see :mod:`.compat`) runs
the backbone, takes the LM head's weight (gathered under FSDP2 and DeepSpeed ZeRO-3) and hands the hidden states to
its ``_ChunkedLogProbFunction.apply``. While
:func:`fused_loss_request` is open, :class:`GrpoExtHead` (installed in that slot by ``_log_probs_through_grpo_ext``)
takes that call: it picks the completion rows out of the hidden states and computes the whole GRPO loss from them
with :func:`grpo_ext.grpo_loss_from_hidden` (each chunk's logits exist once; the gradients for the hidden states and
the head are formed in the pass), stores the result on the request, and returns zero log-probs that TRL's forward
reshapes and discards. Without an open request, or when the call cannot be fused (``request.refusal`` says why), it
is the chunked log-prob pass of :mod:`.log_probs`, and the loss is computed from those log-probs as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ... import ops
from ...ops import tied_embedding
from ...results import GRPOLossOutput
from . import compat
from .log_probs import _compute_dtype, _GrpoExtLogProbs, full_logits_log_probs, full_logits_log_probs_and_entropy


@dataclasses.dataclass
class FusedLossRequest:
    """What the fused head needs to compute the loss of one ``_compute_loss`` call, and what it leaves there.

    Attributes:
        completion_ids: ``[B, T]`` int64, the scored ids.
        completion_mask: ``[B, T]``, the completion's attention mask (which rows TRL's compact layout keeps).
        input_length: ``P + T``, the length of the sequences the forward sees.
        loss_options: keyword arguments of :func:`grpo_ext.grpo_loss_from_hidden` besides the hidden states, the
            head and the ids (advantages, the loss mask, every loss option).
        want_logps: also return the detached ``[B, T]`` log-probs (the fused pass' own; for the clip metrics).
        token_weights: for the masks that need per-token values before the loss (TRL's ``top_entropy_quantile`` and
            ``off_policy_mask_threshold``): called with the detached ``[B, T]`` log-probs and entropies of a no-grad
            chunked pass over the completion rows, it returns the loss options they set (``is_weights`` and, for the
            entropy bonus, ``entropy_weights``).
        output: the loss output, set by the head.
        logps: the detached log-probs when ``want_logps``.
        token_entropy: the detached ``[B, T]`` entropies of the fused pass, set by the head.
        refusal: why the call fell back to the log-prob pass, set by the head; None when fused.
        tied: the tied input embedding's lookups in this forward (:func:`tied_lookup_during`), whose weight alias
            the head hands the loss; None otherwise.
    """

    completion_ids: Tensor
    completion_mask: Tensor
    input_length: int
    loss_options: dict[str, Any]
    want_logps: bool = False
    token_weights: Callable[[Tensor, Tensor], dict[str, Tensor | None]] | None = None
    token_entropy: Tensor | None = None
    output: GRPOLossOutput | None = None
    logps: Tensor | None = None
    refusal: str | None = None
    tied: tied_embedding.SharedTiedGradient | None = None


_REQUEST: contextvars.ContextVar[FusedLossRequest | None] = contextvars.ContextVar("grpo_ext_trl_fused", default=None)


@contextlib.contextmanager
def tied_lookup_during(model: torch.nn.Module, request: FusedLossRequest) -> Iterator[None]:
    """While open, a trained tied input embedding of ``model`` looks its tokens up so that the fused loss of
    ``request`` hands autograd one ``[V, H]`` gradient of that weight instead of two
    (:func:`grpo_ext.ops.tied_embedding.sharing_tied_gradient`; README, "Tied embeddings"). Any other model runs as
    it is."""
    weight = getattr(model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None, "weight", None)
    if not isinstance(weight, Tensor):
        yield
        return
    with tied_embedding.sharing_tied_gradient(model, weight) as request.tied:
        yield


@contextlib.contextmanager
def fused_loss_request(request: FusedLossRequest) -> Iterator[FusedLossRequest]:
    """While open, the next fused-head forward computes ``request``'s loss instead of log-probs."""
    token = _REQUEST.set(request)
    try:
        yield request
    finally:
        _REQUEST.reset(token)


def _completion_rows(request: FusedLossRequest, hidden: Tensor) -> tuple[Tensor | None, str | None]:
    """The ``[B, T, H]`` hidden states scoring the completion ids, from the rows TRL's forward passes, or a refusal.

    TRL passes either every shifted position (``[B * (P + T - 1), H]``: 1.16 off Triton devices) or only the
    positions with a label (the completion tokens whose mask is set), in row-major order.
    """
    batch, length = request.completion_ids.shape
    size = hidden.shape[-1]
    if compat.head_rows_are_compact(hidden.device):  # compact: scatter the labelled rows back into [B, T]
        kept = request.completion_mask.to(hidden.device) != 0
        if hidden.shape[0] != int(kept.sum()):
            return None, f"the forward scored {hidden.shape[0]} rows, not the batch's {int(kept.sum())} tokens"
        return hidden.new_zeros(batch, length, size).masked_scatter(kept.unsqueeze(-1), hidden), None
    if hidden.shape[0] != batch * (request.input_length - 1):
        return None, f"the forward scored {hidden.shape[0]} rows, not the batch's {batch} x {request.input_length - 1}"
    return hidden.view(batch, request.input_length - 1, size)[:, -length:], None


def _head_options(final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
                  outputs: tuple[str, ...] = ("log_probs",)) -> tuple[float | None, float, tuple[str, ...]]:
    """TRL's optional head arguments with their defaults."""
    return final_logit_softcapping, logit_scale, outputs


class GrpoExtHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` (same ``apply`` arguments and outputs) while grpo_ext runs."""

    @staticmethod
    def apply(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
              chunk_size: int, *head_options: Any) -> tuple[Tensor | None, ...]:  # fmt: skip
        """The fused loss of the open request (zero log-probs returned), else :class:`_GrpoExtLogProbs`'s pass.

        ``head_options``: TRL's ``(final_logit_softcapping, logit_scale, outputs)``, each optional, as
        :meth:`_GrpoExtLogProbs.forward` takes them.
        """
        args = (hidden, weight, bias, targets, temperature, chunk_size, *head_options)
        final_logit_softcapping, logit_scale, outputs = _head_options(*head_options)
        request = _REQUEST.get()
        if request is None or request.refusal is not None:
            return _GrpoExtLogProbs.apply(*args)
        if request.output is not None:
            raise RuntimeError(
                "grpo_ext.integrations.trl: the model's fused head ran twice for one loss (a "
                "_get_per_token_logps_and_entropies that splits the batch?); use logps_backend='plain'"
            )
        rows, request.refusal = _completion_rows(request, hidden)
        if request.refusal is not None:
            return _GrpoExtLogProbs.apply(*args)

        dtype = _compute_dtype(hidden)  # the autocast dtype when autocast is on, as TRL's head computes
        if request.tied is not None:  # after the body's lookup
            weight = request.tied.head_weight(weight)
        with torch.autocast(hidden.device.type, enabled=False):
            ids = request.completion_ids.to(hidden.device)
            if request.token_weights is not None:
                request.loss_options.update(_token_weights(request, rows, weight, bias, dtype, ids, temperature,
                                                           chunk_size, final_logit_softcapping, logit_scale))
            # the master weight as it is: the op casts it for its GEMMs (inside its gradient's buffer)
            out = ops.grpo_loss_from_hidden(
                rows, weight, ids, lm_head_bias=bias, temperature=temperature, logit_scale=logit_scale,
                logit_softcap=final_logit_softcapping, compute_dtype=dtype, return_token_logps=True,
                **request.loss_options,
            )  # fmt: skip
            request.output = GRPOLossOutput(out.loss, out.metrics)
            request.token_entropy = out.token_entropy
            if request.want_logps:  # the pass' own log-probs (0 at masked tokens, which the metrics never read)
                request.logps = out.token_logps
        zeros = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        return zeros, (zeros if "entropy" in outputs else None), None, None, None


def _token_weights(request: FusedLossRequest, rows: Tensor, weight: Tensor, bias: Tensor | None,
                   dtype: torch.dtype, ids: Tensor, temperature: float, chunk_size: int, softcap: float | None,
                   scale: float) -> dict[str, Tensor | None]:  # fmt: skip
    """``request.token_weights`` of the per-token log-probs and entropies of a no-grad pass over ``rows`` (chunked:
    one chunk of logits at a time, as the fused loss; GEMMs in ``dtype``), before the loss that they weigh."""
    with torch.no_grad():
        logps, entropy, *_ = _GrpoExtLogProbs.apply(
            rows.reshape(-1, rows.shape[-1]).to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
            ids.reshape(-1), temperature, chunk_size, softcap, scale, ("log_probs", "entropy"),
        )  # fmt: skip
    return request.token_weights(logps.view(ids.shape), entropy.view(ids.shape))


class GrpoExtHeadTwoOutputs:
    """:class:`GrpoExtHead` under TRL 1.14's ``_ChunkedLogProbFunction`` contract (eight arguments; log-probs and
    entropy, both always computed)."""

    @staticmethod
    def apply(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
              chunk_size: int, final_logit_softcapping: float | None = None,
              logit_scale: float = 1.0) -> tuple[Tensor, Tensor]:  # fmt: skip
        head_options = (final_logit_softcapping, logit_scale, ("log_probs", "entropy"))
        logps, entropy, *_ = GrpoExtHead.apply(hidden, weight, bias, targets, temperature, chunk_size, *head_options)
        return logps, entropy


@contextlib.contextmanager
def _log_probs_through_grpo_ext() -> Iterator[None]:
    """While open, TRL's chunked LM head runs on grpo_ext: the fused loss of an open request, else the log-prob pass.

    TRL looks its ``_ChunkedLogProbFunction`` up at call time (1.15 and 1.16: ``trl.trainer.utils``, from
    ``add_fused_lm_head``'s forward; 1.14: ``trl.trainer.grpo_trainer``, from ``_chunked_logps``); swapping that one
    name keeps the rest of the forward (backbone, PEFT, multimodal inputs, FSDP gathers, label masking) TRL's own.
    TRL 1.14's full-logits path gets grpo_ext's ``selective_log_softmax`` in place of its two functions. Every swap
    is undone on exit, so other TRL trainers in the process are unaffected.
    """
    module, name = compat.head_slot()
    swaps = [(module, name, GrpoExtHead if compat.has_fused_lm_head() else GrpoExtHeadTwoOutputs)]
    if not compat.has_fused_lm_head():
        swaps += [
            (module, "selective_log_softmax_and_entropy", full_logits_log_probs_and_entropy),
            (module, "selective_log_softmax", full_logits_log_probs),
        ]
    previous = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in swaps]
    for owner, attr, replacement in swaps:
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        for owner, attr, value in previous:
            setattr(owner, attr, value)
