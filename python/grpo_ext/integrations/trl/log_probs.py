"""The log-prob pass of TRL's fused LM head through grpo_ext.selective_log_softmax (see the package docstring), and
TRL 1.14's full-logits log-prob functions on the same op.

The chunking and the chunk's logits are grpo_ext's shared LM-head helpers (:mod:`grpo_ext.ops.lm_head`), the ones
grpo_loss_from_hidden uses; ``logit_scale`` and soft-capping go through the kernels' logits options.
"""

from __future__ import annotations

from typing import Any

import torch
import trl.trainer.utils as _trl_utils
from torch import Tensor

from ... import ops
from ...ops.lm_head import chunk_rows, project

#: Bytes per logit assumed when sizing a chunk: float32, the widest a chunk's logits (or the backward's float32 copy
#: of their gradient) take, so each takes at most ops.lm_head.LOGITS_CHUNK_BYTES.
LOGIT_BYTES = 4

# TRL's per-token outputs of the fused LM head that GRPO uses; the others (log_sum_sq_probs, ...) are not computed.
_LOG_PROB_OUTPUTS = ("log_probs", "entropy")


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    # The projection runs in the autocast dtype when autocast is on, as TRL's fused head does.
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


class _GrpoExtLogProbs(torch.autograd.Function):
    """Stands in for TRL's ``ChunkedLogProbFunction`` (same arguments, same five outputs) while the pass runs.

    Forward: per row chunk, the LM-head logits and :func:`grpo_ext.selective_log_softmax` (log-prob of the label,
    entropy when asked), with no graph kept. Backward: each chunk's logits are recomputed, the grpo_ext backward
    turns them into ``d/dlogits``, and the two gradient products are accumulated in float32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> tuple[Tensor, Tensor | None, None, None, None]:
        """Per-token log-probs (and entropy) of ``hidden @ weight.T + bias``.

        Args:
            ctx: autograd context.
            hidden: ``[N, H]`` hidden states (any float dtype).
            weight: ``[V, H]`` LM-head weight.
            bias: ``[V]`` LM-head bias or None.
            targets: ``[N]`` int64 label ids in ``[0, V)``.
            temperature: the logits are divided by it (> 0).
            chunk_size: TRL's vocabulary tile width; unused (grpo_ext reads whole rows).
            final_logit_softcapping: soft-cap of the scaled logits, or None.
            logit_scale: multiplies the logits before the cap.
            outputs: TRL's requested per-token fields; only ``log_probs`` and ``entropy`` are supported.

        Returns:
            ``(log_probs [N], entropy [N] or None, None, None, None)``, float32 (float64 for float64 inputs).
        """
        unsupported = sorted(set(outputs) - set(_LOG_PROB_OUTPUTS))
        if unsupported:
            raise ValueError(
                f"outputs={outputs!r}: grpo_ext.integrations.trl computes only {_LOG_PROB_OUTPUTS}, not {unsupported}"
            )
        ctx.set_materialize_grads(False)  # entropy is often logged only; a None gradient skips its term
        want_entropy = "entropy" in outputs
        dtype = _compute_dtype(hidden)
        ctx.compute_dtype, ctx.temperature = dtype, float(temperature)
        ctx.want_entropy = want_entropy
        # the scale and the cap go through the kernels (docs/math.md section 2), the gradient to the raw logits
        ctx.logit_options = dict(
            temperature=ctx.temperature, logit_scale=float(logit_scale), logit_softcap=final_logit_softcapping
        )
        ctx.save_for_backward(hidden, weight, bias, targets)

        logps_chunks: list[Tensor] = []
        entropy_chunks: list[Tensor] = []
        rows = chunk_rows(hidden.shape[0], weight.shape[0], LOGIT_BYTES)
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c = weight.to(dtype)
            bias_c = None if bias is None else bias.to(dtype)
            for start in range(0, hidden.shape[0], rows):
                logits = project(hidden[start : start + rows].to(dtype), weight_c, bias_c)
                chunk = ops.selective_log_softmax(
                    logits, targets[start : start + rows], return_entropy=want_entropy, **ctx.logit_options
                )
                logps_chunks.append(chunk.logps)
                if want_entropy:
                    entropy_chunks.append(chunk.entropy)
                del logits, chunk  # before the next chunk's logits exist (not two chunks alive at once)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if not logps_chunks:  # no row to score (every label ignored): empty outputs, still part of the graph
            empty = hidden.new_zeros((0,), dtype=out_dtype)
            return empty, (empty.clone() if want_entropy else None), None, None, None
        logps = torch.cat(logps_chunks)
        entropy = torch.cat(entropy_chunks) if want_entropy else None
        return logps, entropy, None, None, None

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor | None, grad_entropy: Tensor | None, *unused: Any) -> tuple:
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not ctx.want_entropy:
            grad_entropy = None
        nothing = (None,) * 9
        if (grad_logps is None and grad_entropy is None) or not (need_hidden or need_weight or need_bias):
            return nothing
        dtype = ctx.compute_dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
        rows = chunk_rows(hidden.shape[0], weight.shape[0], LOGIT_BYTES)
        # Under DeepSpeed ZeRO-3 the head is partitioned again by now: gather it for the recomputation.
        with _trl_utils.maybe_gather_lm_head_ctx(weight, bias), torch.autocast(hidden.device.type, enabled=False):
            weight_c = weight.to(dtype)
            bias_c = None if bias is None else bias.to(dtype)
            weight_acc = weight_c.to(acc) if need_hidden else None  # once, not per chunk
            for start in range(0, hidden.shape[0], rows):
                stop = start + rows
                hidden_c = hidden[start:stop].to(dtype)
                raw = project(hidden_c, weight_c, bias_c).detach().requires_grad_(True)
                with torch.enable_grad():
                    chunk = ops.selective_log_softmax(
                        raw, targets[start:stop], return_entropy=grad_entropy is not None, **ctx.logit_options
                    )
                    terms, seeds = [], []
                    if grad_logps is not None:
                        terms.append(chunk.logps)
                        seeds.append(grad_logps[start:stop].to(chunk.logps.dtype))
                    if grad_entropy is not None:
                        terms.append(chunk.entropy)
                        seeds.append(grad_entropy[start:stop].to(chunk.entropy.dtype))
                    (grad_raw,) = torch.autograd.grad(terms, raw, seeds)
                grad_raw = grad_raw.to(acc)
                if grad_hidden is not None:
                    grad_hidden[start:stop].addmm_(grad_raw, weight_acc)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_raw.t(), hidden_c.to(acc))
                if grad_bias is not None:
                    grad_bias += grad_raw.sum(dim=0)
                del raw, chunk, terms, grad_raw  # likewise
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *nothing[3:],
        )


def full_logits_log_probs_and_entropy(logits: Tensor, index: Tensor, entropy_requires_grad: bool = True,
                                      temperature: float = 1.0,
                                      row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """TRL 1.14's ``selective_log_softmax_and_entropy`` (its full-logits path) on grpo_ext.selective_log_softmax.

    Args:
        logits: ``[B, T, V]`` (or ``[N, V]``) logits, any float dtype, already aligned with ``index``.
        index: ``[B, T]`` (or ``[N]``) int64 ids, one per row.
        entropy_requires_grad: whether the entropy keeps its gradient (TRL: only with an entropy bonus).
        temperature: the logits are divided by it (> 0).
        row_mask: rows where it is 0 score 0 (log-prob and entropy), with no gradient; None keeps every row.

    Returns:
        ``(log_probs, entropy)`` shaped like ``index``, float32 (float64 for float64 logits).
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])} (one id per row), got {tuple(index.shape)}")
    out = ops.selective_log_softmax(logits, index, temperature=temperature, return_entropy=True)
    logps, entropy = out.logps, out.entropy
    if not entropy_requires_grad:
        entropy = entropy.detach()
    if row_mask is not None:
        keep = row_mask != 0
        logps, entropy = torch.where(keep, logps, 0.0), torch.where(keep, entropy, 0.0)
    return logps, entropy


def full_logits_log_probs(logits: Tensor, index: Tensor, temperature: float = 1.0,
                          row_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """TRL 1.14's ``selective_log_softmax`` (its full-logits path, one id per row) on grpo_ext; see
    :func:`full_logits_log_probs_and_entropy`."""
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])} (one id per row), got {tuple(index.shape)}")
    logps = ops.selective_log_softmax(logits, index, temperature=temperature).logps
    return logps if row_mask is None else torch.where(row_mask != 0, logps, 0.0)
