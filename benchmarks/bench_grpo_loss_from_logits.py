"""Microbenchmark of the GRPO loss from logits, forward + backward: eager "TRL way", torch.compile, Liger, grpo_ext.

Peers, side by side on the same inputs:

* ``eager``: TRL's way in eager PyTorch: ``logits.float() / temperature``, log-softmax through ``logsumexp`` and a
  gather, the entropy under ``no_grad`` (a metric) (``trl_style.trl_style_selective_log_softmax``), then the loss of
  ``trl_style.trl_style_loss``.
* ``compile``: ``torch.compile(grpo_ext.reference.grpo_loss_from_logits)``, compilation excluded from the timing;
  "n/a" with the reason when compiling fails on the machine.
* ``liger``: Liger-Kernel's ``triton_grpo_loss``, when ``liger-kernel`` is installed and the device is CUDA; n/a with
  the reason otherwise.
* ``grpo_ext``: ``grpo_ext.grpo_loss_from_logits``.
* ``grpo_ext+inplace``: ``inplace_grad=True``; each call first clones the logits (the in-place call consumes them),
  and that clone is part of the time: the row is about memory.
* ``grpo_ext/single-read`` (CUDA): ``grpo_ext`` with ``GRPO_EXT_LOGITS_SINGLE_READ=1``: rows that fit on chip staged
  there (over a cluster of up to 16 blocks of 256 threads) and read once, where the default (the two-read pass,
  faster on an H100 and an H200) reads each row a second time to write its gradient (benchmarks/NOTES.md).

Each call computes the loss and its gradient w.r.t. the logits. Before timing, every peer but compile is checked
against ``grpo_ext.reference.grpo_loss_from_logits`` in float64 on the first rows of the same inputs
(``--check-rows``). Inputs (``logits_inputs.make_inputs``): logits ``2 * randn`` in the case's dtype, random ids,
``old_logps`` and ``ref_logps`` near the policy's own log-probs, prefix masks of random length, ``dapo``,
temperature 0.9.

Bytes (``fused_loss.logits_bytes``, since 2026-11-29): the least the op must move on the case's inputs, with ``K``
the kept rows (tokens) of the mask (about half of them here), ``e`` bytes per logit::

    bytes = K*V*e                  # the kept rows' logits read once (a masked row is never read)
          + N*V*e                  # the gradient written once, every row (a masked row's is zeros)
          + K*(8 + 4 + 4*[beta!=0])  # id, old_logps, ref_logps of a kept row
          + N*4 + B*4              # the int32 mask, an advantage per scored sequence

(``2 * N * V * e`` before: it counted a read of every masked row.) ``%copy`` compares the achieved rate with a
measured device copy. Peak memory (CUDA): the allocator's peak above what was allocated before the call.

Usage::

    python benchmarks/bench_grpo_loss_from_logits.py           # default sizes for the device
    python benchmarks/bench_grpo_loss_from_logits.py --quick   # smoke run (CI)
    python benchmarks/bench_grpo_loss_from_logits.py --sizes 8192x151936 --dtypes bfloat16
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and the shared modules, wherever run from

import torch
from torch import Tensor

import fused_loss
import grpo_ext
from fused_loss import Step
from harness import peers
from logits_inputs import TEMPERATURE
from trl_style import EPSILON


def make_steps(inputs: dict[str, Any], beta: float, device: torch.device) -> tuple[dict[str, Step | None], dict]:
    """Every peer but compile on ``inputs``: ``(steps, notes)``; a step returns ``(loss, grad_logits)``."""
    base = inputs["logits"]
    leaf = base.detach().requires_grad_(True)
    kwargs = fused_loss.loss_kwargs(inputs, beta)
    ids, adv, mask = inputs["ids"], inputs["advantages"], inputs["mask"]
    steps: dict[str, Step | None] = {}
    notes: dict[str, str] = {}

    def eager():
        loss = fused_loss.eager_loss(leaf, inputs, beta)
        return loss, torch.autograd.grad(loss, leaf)[0]

    source = base.detach().requires_grad_(True)

    def fused_inplace():
        logits = source.clone()  # a non-leaf the call may consume
        out = grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, inplace_grad=True, **kwargs)
        return out.loss, torch.autograd.grad(out.loss, source)[0]

    fused = fused_loss.loss_step(grpo_ext.grpo_loss_from_logits, [leaf], inputs, beta)
    steps.update(eager=eager, grpo_ext=fused, **{"grpo_ext+inplace": fused_inplace})
    if device.type == "cuda":  # the launcher reads the variable at each call
        steps["grpo_ext/single-read"] = peers.with_env({"GRPO_EXT_LOGITS_SINGLE_READ": "1"}, fused)
    steps["liger"], reason = liger_step(inputs, leaf, beta, device)
    if reason:
        notes["liger"] = reason
    return steps, notes


def liger_step(inputs: dict[str, Any], leaf: Tensor, beta: float, device: torch.device):
    """Liger-Kernel's triton_grpo_loss (it takes logits with one extra final position), or (None, why)."""
    if device.type != "cuda":
        return None, "Liger-Kernel's Triton kernels need a CUDA device"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:  # not installed, or its Triton does not import
        return None, f"liger-kernel unavailable ({peers.short_reason(exc)}); pip install liger-kernel"
    padded = torch.cat([leaf.detach(), leaf.detach()[:, -1:]], dim=1).requires_grad_(True)
    mask = inputs["mask"]

    def step():
        out = triton_grpo_loss(padded, inputs["old_logps"], inputs["ref_logps"], inputs["ids"], inputs["advantages"],
                               mask, TEMPERATURE, beta, EPSILON, EPSILON, False)  # fmt: skip
        per_token = out[0] if isinstance(out, tuple) else out
        if per_token.dim() == 0:  # newer versions reduce themselves
            loss = per_token
        else:
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        grad = torch.autograd.grad(loss, padded)[0][:, :-1]
        return loss, grad

    return step, None


if __name__ == "__main__":
    fused_loss.main(__file__, __doc__, "logits", make_steps)
