"""The chunked LM head, written once for grpo_loss_from_hidden and the TRL integration: how many token rows a
chunk of logits holds, and a chunk's logits from the hidden states (bias, logit scale and soft-capping included).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import accumulate_dtype

#: Bytes of logits one chunk may hold: GEMMs stay large while the memory for logits stays bounded.
LOGITS_CHUNK_BYTES = 256 << 20


def chunk_rows(rows: int, vocab: int, element_size: int, budget: int | None = None) -> int:
    """Token rows per chunk: the largest power of two whose ``[rows, vocab]`` logits fit in ``budget`` bytes.

    Args:
        rows: the number of token rows to score (the chunk never exceeds it, and is at least 1).
        vocab: ``V``, the logits' row length.
        element_size: bytes per logit (``torch.Tensor.element_size()`` of the logits' dtype).
        budget: bytes one chunk of logits may take (None: LOGITS_CHUNK_BYTES, read at call time).
    """
    budget = LOGITS_CHUNK_BYTES if budget is None else budget
    fit = max(1, budget // max(1, vocab * element_size))
    return max(1, min(rows, 1 << (fit.bit_length() - 1)))


def hidden_chunk_budget(vocab: int, size: int) -> int:
    """Bytes a chunk of grpo_loss_from_hidden's logits may take: the float32 ``[V, H]`` weight gradient's size, which
    the op holds anyway, and at least LOGITS_CHUNK_BYTES (benchmarks/NOTES.md, issue 14 point 7; issue 31 item 2).

    The same rule on CPU and CUDA. Each chunk pays a read and write of the ``[V, H]`` float32 accumulator and
    small-M GEMM blocking, so fewer, larger chunks are faster on both (an H100, N=8192, H=4096, V=151936 in bf16:
    70.4 ms with 256 MiB chunks, 48.6 ms with this rule's 8192 rows, against 41.3 ms for the three GEMMs). The peak
    stays flat in N: the weight gradient, a chunk of logits at most its size, and a master weight's cast; where one
    chunk covers every row it is lower (the weight gradient is then written in the weight's dtype, with no float32
    accumulator: 3.87 GB against 3.96 GB there), which ``head_chunking`` takes up to chunk + H rows.
    """
    return max(LOGITS_CHUNK_BYTES, vocab * size * 4)


def head_chunking(hidden: Tensor, lm_head_weight: Tensor, weight_grad: bool | None = None) -> tuple[int, int]:
    """grpo_loss_from_hidden's default chunking, in one place: ``(default_chunk_size, one_chunk_rows)``.

    The rule's chunk is the largest power of two of rows whose logits fit in :func:`hidden_chunk_budget` (the float32
    ``[V, H]`` weight gradient's size, at least 256 MiB), on any device. With a weight gradient, more than one chunk
    costs a ``[V, H]`` buffer in the compute dtype that one chunk does without (:func:`_one_chunk_saving`): a master
    weight's cast, which one chunk makes inside its gradient's buffer, or the float32 accumulator's narrowed copy,
    where one chunk's product is the gradient. So up to ``chunk + H`` rows (``one_chunk_rows``) one chunk peaks no
    higher, and it is faster (no accumulator traffic, one longer GEMM): 1024 + 896 rows at Qwen2.5-0.5B's head in
    bf16, where the rule alone stopped at 1024 (benchmarks/NOTES.md, "The head at H 896"). ``default_chunk_size``
    applies that limit to the B x T rows; the op, once it has counted them, to the rows its masks keep (a padded
    batch often fits where its B x T does not).

    A pure function of the shapes, dtypes and grad flags (no data is read; fake or meta tensors do).

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]``, in the compute dtype.
        lm_head_weight: ``[V, H]``, in its own dtype (a float32 master weight under bf16 GEMMs, say).
        weight_grad: whether the op computes the weight's gradient (None: grad mode and ``requires_grad``).
    """
    size, vocab = hidden.shape[-1], lm_head_weight.shape[0]
    rows = hidden.numel() // size if size else 0
    chunk = chunk_rows(rows, vocab, hidden.element_size(), hidden_chunk_budget(vocab, size))
    if weight_grad is None:
        weight_grad = torch.is_grad_enabled() and lm_head_weight.requires_grad
    saving = _one_chunk_saving(hidden, lm_head_weight) if weight_grad else 0
    one_chunk = chunk + saving // max(1, vocab * hidden.element_size())
    return (rows if rows <= one_chunk else chunk), one_chunk


def default_chunk_size(hidden: Tensor, lm_head_weight: Tensor, weight_grad: bool | None = None) -> int:
    """grpo_loss_from_hidden's ``chunk_size`` when None (:func:`head_chunking`): the rule's chunk, or every row in
    one chunk up to :func:`one_chunk_rows`. Args as :func:`head_chunking`."""
    return head_chunking(hidden, lm_head_weight, weight_grad)[0]


def one_chunk_rows(hidden: Tensor, lm_head_weight: Tensor, weight_grad: bool | None = None) -> int:
    """Rows up to which one chunk peaks no higher than the rule's chunks (:func:`head_chunking`): the rule's chunk,
    plus H where the chunked path holds an extra ``[V, H]``. Args as :func:`head_chunking`."""
    return head_chunking(hidden, lm_head_weight, weight_grad)[1]


def _one_chunk_saving(hidden: Tensor, weight: Tensor) -> int:
    """Bytes the chunked path holds, beside its float32 accumulator and a chunk of logits, that one chunk does not
    (grpo_loss_from_hidden's forward): a master weight of twice the compute width is cast into one chunk's gradient
    buffer (:class:`SharedWeightGradient`) but into a buffer of its own beside the accumulator; a half-precision
    weight's gradient is one chunk's product, but the accumulator narrowed into a new buffer after several. Either is
    ``[V, H]`` in the compute dtype. 0 otherwise (float32 weights and GEMMs: the accumulator is the gradient)."""
    cast_shared = weight.element_size() == 2 * hidden.element_size()
    narrowed = weight.dtype == hidden.dtype and accumulate_dtype(hidden.dtype) != hidden.dtype
    return weight.numel() * hidden.element_size() if cast_shared or narrowed else 0


def project(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, logit_scale: float = 1.0, softcap: float | None = None
) -> Tensor:
    """LM-head logits of a chunk of rows, before the temperature.

    Args:
        hidden: ``[n, H]``.
        weight: ``[V, H]``, the dtype of ``hidden``.
        bias: ``[V]`` or None.
        logit_scale: multiplies the logits (1.0 for most models; Cohere's ``logit_scale``).
        softcap: ``softcap * tanh(z / softcap)`` after the scale (Gemma 2's final soft-capping), or None.

    Returns:
        ``[n, V]`` logits, in ``hidden``'s dtype when no scale or cap applies, else float32.
    """
    logits = torch.addmm(bias, hidden, weight.t()) if bias is not None else hidden @ weight.t()
    if logit_scale == 1.0 and softcap is None:
        return logits
    logits = logits.float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def product(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` in ``dtype`` (float32 for half-precision ``a`` and ``b`` when asked), into a new tensor."""
    if a.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda:  # cuBLAS: half-precision inputs, float32 accumulator and output
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a.to(dtype), b.to(dtype))


def accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 whatever the dtype of ``a`` and ``b``, without an [M, K] temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:  # cuBLAS: half-precision inputs, float32 accumulator and output
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


#: Elements the last round of :func:`widen_in_place` converts through a copy (rounds below this size would be many
#: and tiny).
_WIDEN_TAIL = 1 << 16


class SharedWeightGradient(NamedTuple):
    """One buffer that holds, in turn, a master weight's half-width copy, the half-width weight gradient and the
    full-width weight gradient: a float32 ``[V, H]`` weight under bf16/fp16 GEMMs costs one ``[V, H]`` float32
    allocation (the gradient's, needed anyway) instead of three (cast, product, widened product).

    ``grad``: ``[V, H]`` in the weight's dtype, the gradient once :func:`widen_in_place` has run. ``cast``: the
    first half of ``grad``'s bytes as ``[V, H]`` in the compute dtype, the weight cast into it. ``product``: the
    second half, where the caller writes the half-width gradient (after the last read of ``cast``:
    :func:`widen_in_place` overwrites it).
    """

    grad: Tensor
    cast: Tensor
    product: Tensor


def shared_weight_gradient(weight: Tensor, dtype: torch.dtype) -> SharedWeightGradient | None:
    """``weight`` cast to ``dtype`` inside the buffer of its own gradient (:class:`SharedWeightGradient`), or None
    when ``dtype`` is not half the weight's width (float32 weight, bfloat16/float16 GEMMs; float64, float32)."""
    if weight.element_size() != 2 * dtype.itemsize:
        return None
    grad = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    halves = grad.view(-1).view(dtype)
    count = weight.numel()
    cast = halves[:count].view(weight.shape)
    cast.copy_(weight)
    return SharedWeightGradient(grad, cast, halves[count:].view(weight.shape))


def widen_in_place(shared: SharedWeightGradient) -> Tensor:
    """``shared.grad`` = ``shared.product`` converted to the full width, in place; returns ``shared.grad``.

    Element i's wide value goes to bytes ``[2ki, 2k(i+1))`` (k: the narrow width), its narrow value sits at
    ``[kn + ki, kn + k(i+1))`` (n elements). A round converts ``[s, e)`` with ``e - s`` half of what is left: its
    writes end at ``2ke <= kn + ks``, where its reads begin, and cover only narrow values earlier rounds converted.
    So each round is one ordinary copy between disjoint ranges (about 11 rounds for a 151936 x 896 weight), on the
    CPU and on the device's stream alike.
    """
    wide = shared.grad.view(-1)
    narrow = shared.product.view(-1)
    count = wide.numel()
    start = 0
    while count - start > _WIDEN_TAIL:
        stop = start + (count - start) // 2
        wide[start:stop].copy_(narrow[start:stop])
        start = stop
    wide[start:].copy_(narrow[start:].clone())  # the tail overlaps its own source: through a copy
    return shared.grad
