"""The input embedding of a weight the LM head shares (tied embeddings), with its gradient rows added into the head's
weight gradient in place: one float32 ``[V, H]`` gradient buffer in the step's backward instead of two.

With tied embeddings autograd gets two gradients for the one weight: the fused head's ``[V, H]`` (made in the
forward by :func:`grpo_ext.grpo_loss_from_hidden`) and, at the end of the backward, ``EmbeddingBackward0``'s dense
``[V, H]``, which exists only to be added to the first. Both are alive together at the step's peak (benchmarks/
NOTES.md, "What holds the step's peak on the CPU": a third of it at Qwen2.5-0.5B's shape). Here the head's weight
enters through an alias whose gradient hook keeps a reference to the head's gradient, and the embedding's backward
adds its ``[N, H]`` rows into that tensor in a fixed order (:func:`_add_rows`) and gives autograd no gradient of its
own. The weight's ``AccumulateGrad`` runs after both nodes (it waits for every edge into it), so DDP's gradient
hooks, which fire there, see the sum; where the head's gradient never arrived (it did not need one), the embedding
returns its dense gradient as ``nn.Embedding`` would. Used by the trainer's fused path and the TRL integration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


class _TiedLookup(torch.autograd.Function):
    """``weight[ids]`` whose backward adds its rows into the head's gradient held by ``sink`` (see the module)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor, sink: list[Tensor], padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.sink, ctx.padding_idx, ctx.weight_shape, ctx.weight_dtype = sink, padding_idx, weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[None, Tensor | None, None, None]:
        (ids,) = ctx.saved_tensors
        flat_ids = ids.reshape(-1)
        rows = grad_rows.reshape(flat_ids.numel(), -1)
        if ctx.padding_idx is not None:  # nn.Embedding's rule: the padding row gets no gradient (no host sync here)
            rows = rows * (flat_ids != ctx.padding_idx).unsqueeze(1).to(rows.dtype)
        head_grad = ctx.sink.pop() if ctx.sink else None
        ctx.sink = None  # the head's gradient now referenced by autograd's buffer alone, so AccumulateGrad steals it
        if head_grad is None:
            grad = torch.zeros(ctx.weight_shape, dtype=ctx.weight_dtype, device=rows.device)
            _add_rows(grad, flat_ids, rows)
            return None, grad, None, None
        _add_rows(head_grad, flat_ids, rows)
        return None, None, None, None


def _add_rows(target: Tensor, ids: Tensor, rows: Tensor) -> None:
    """``target[ids[i]] += rows[i]`` in a fixed order: ``index_put_`` with ``accumulate=True`` on CUDA (sort-based;
    ``index_add_`` there is atomic), ``index_add_`` elsewhere (serial; torch lists the CPU ``index_put_`` accumulate
    as nondeterministic)."""
    rows = rows.to(target.dtype)
    if target.is_cuda:
        target.index_put_((ids,), rows, accumulate=True)
    else:
        target.index_add_(0, ids, rows)


def tied_embedding(model_body: torch.nn.Module, head_weight: Tensor) -> torch.nn.Embedding | None:
    """The body's input embedding when it looks its tokens up as ``nn.Embedding`` does (its class's ``forward`` is
    ``nn.Embedding.forward``: a plain one, or FSDP2's ``FSDPEmbedding`` wrapper class) with ``head_weight`` as its
    weight, and trains; else None (untied, a frozen or LoRA-adapted head, a scaled or sparse embedding: the model's
    own lookup).

    Args:
        model_body: the causal LM's base model (``get_input_embeddings``).
        head_weight: the LM head's weight ``[V, H]`` as the fused op takes it.
    """
    embedding = model_body.get_input_embeddings() if hasattr(model_body, "get_input_embeddings") else None
    if not isinstance(embedding, torch.nn.Embedding) or type(embedding).forward is not torch.nn.Embedding.forward:
        return None  # a subclass with a forward of its own (Gemma's scaled lookup) is not a plain lookup
    if embedding.weight is not head_weight:
        return None
    if not head_weight.requires_grad or embedding.max_norm is not None or embedding.sparse:
        return None
    if "forward" in embedding.__dict__:  # a forward replaced on the instance (accelerate's device hooks): leave it
        return None
    return embedding


class SharedTiedGradient:
    """The lookups of a tied embedding during one body forward (:func:`sharing_tied_gradient`), and the alias of its
    weight to hand the LM head after it."""

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        self.embedding = embedding
        self.sinks: list[list[Tensor]] = []  # each lookup's sink, in call order

    def head_weight(self, weight: Tensor) -> Tensor:
        """``weight`` as the LM head should take it: the tied weight's alias whose gradient (the head's) goes to the
        last lookup's backward to add its rows into, and on to the weight; ``weight`` itself when it is not the tied
        one or no lookup ran. Call after the body's forward: autograd runs the nodes made later first, so the alias's
        gradient (its hook) is taken before the lookup's backward runs."""
        if not self.sinks or weight is not self.embedding.weight or not torch.is_grad_enabled():
            return weight
        alias = weight.view_as(weight)
        alias.register_hook(self.sinks[-1].append)
        return alias


@contextlib.contextmanager
def sharing_tied_gradient(model_body: torch.nn.Module, head_weight: Tensor) -> Iterator[SharedTiedGradient | None]:
    """While open, each call of the body's tied input embedding (:func:`tied_embedding`; with grad on) is a
    :func:`tied_lookup`, the module's hooks still run around it; yields the :class:`SharedTiedGradient` whose
    :meth:`~SharedTiedGradient.head_weight` the LM head takes after the body, or None where the model keeps its own
    lookup.

    Args:
        model_body: the causal LM's base model (or the causal LM: ``get_input_embeddings``).
        head_weight: the LM head's weight ``[V, H]`` as the fused op takes it.
    """
    embedding = tied_embedding(model_body, head_weight) if torch.is_grad_enabled() else None
    if embedding is None:
        yield None
        return
    shared = SharedTiedGradient(embedding)

    def forward(input_ids: Tensor) -> Tensor:
        inputs_embeds, sink = tied_lookup(embedding, input_ids)
        shared.sinks.append(sink)
        return inputs_embeds

    # Outside torch.compile's graph (a compiled model: TRL's torch_compile=True): traced, the lookup's backward would
    # be fixed at trace time, when no head gradient has reached the sink yet, to the dense fallback.
    embedding.forward = torch.compiler.disable(forward)
    try:
        yield shared
    finally:
        del embedding.forward


def tied_lookup(embedding: torch.nn.Embedding, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``(inputs_embeds, sink)``: the lookup of ``input_ids`` ``[B, L]`` in the tied ``embedding`` (float
    ``[B, L, H]``, as ``embedding(input_ids)``), and the list through which the head's gradient reaches its backward
    (:meth:`SharedTiedGradient.head_weight`; without it the backward returns the dense gradient)."""
    sink: list[Tensor] = []
    return _TiedLookup.apply(input_ids, embedding.weight, sink, embedding.padding_idx), sink
