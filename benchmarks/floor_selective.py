"""``bench_floor.py``'s selective cases: ``selective_log_softmax`` forward and backward, and the fused pass's forward,
beside TRL 1.16's Triton log-prob + entropy kernel (the ``selective`` entry of ``bench_floor.py``'s docstring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import fused_loss
import grpo_ext
from floor_common import BETA, Step, check, draw_inputs, kwargs64, time_rows
from grpo_ext import reference
from harness import cli, peers
from logits_inputs import TEMPERATURE, first_rows
from trl_peers import trl_loss, trl_triton_kernel


def selective_steps(inputs: dict[str, Any], upstream: Tensor,
                    device: torch.device) -> tuple[dict[str, Step | None], dict[str, str]]:  # fmt: skip
    """The selective case's peers on ``inputs``, in the order of their rows.

    ``fwd`` rows (no autograd) return the per-token log-probs and entropies (a loss first for the loss passes);
    ``bwd`` rows return the gradient w.r.t. the logits of ``logps * upstream`` (only the log-probs' backward).
    """
    leaf = inputs["logits"].detach().requires_grad_(True)
    ids, mask, kwargs = inputs["ids"], inputs["mask"], fused_loss.loss_kwargs(inputs, BETA)

    def forward():
        with torch.no_grad():
            return tuple(grpo_ext.selective_log_softmax(leaf, ids, temperature=TEMPERATURE, return_entropy=True))

    def loss_forward():
        with torch.no_grad():
            out = grpo_ext.grpo_loss_from_logits(leaf, ids, inputs["advantages"], mask, return_token_logps=True,
                                                 **kwargs)  # fmt: skip
        return out.loss, out.token_logps, out.token_entropy

    saved = grpo_ext.selective_log_softmax(leaf, ids, temperature=TEMPERATURE).logps

    def backward():
        return (torch.autograd.grad(saved, leaf, upstream, retain_graph=True)[0],)

    trl_names = ("trl-triton fwd", "trl-triton+loss fwd", "trl-triton bwd")
    steps: dict[str, Step | None] = dict.fromkeys(trl_names)
    notes: dict[str, str] = {}
    kernel, reason = trl_triton_kernel(device)
    try:
        trl_saved = kernel(leaf, ids, temperature=TEMPERATURE)[0] if kernel is not None else None
    except Exception as exc:  # e.g. a Triton compile error on this machine
        kernel, reason = None, f"failed: {peers.short_reason(exc)}"
    if kernel is None:
        notes.update(dict.fromkeys(trl_names, reason))
    else:

        def trl_forward():
            with torch.no_grad():
                return kernel(leaf, ids, temperature=TEMPERATURE)

        def trl_loss_forward():  # the kernel skips the masked rows, as the fused pass does
            with torch.no_grad():
                logps, entropy = kernel(leaf, ids, temperature=TEMPERATURE, row_mask=mask)
                return trl_loss(logps, entropy, inputs, BETA)[0], logps, entropy

        def trl_backward():
            return (torch.autograd.grad(trl_saved, leaf, upstream, retain_graph=True)[0],)

        steps.update(zip(trl_names, (trl_forward, trl_loss_forward, trl_backward), strict=True))
    ordered = {"grpo_ext fwd": forward, "trl-triton fwd": steps["trl-triton fwd"], "grpo_ext loss fwd": loss_forward,
               "trl-triton+loss fwd": steps["trl-triton+loss fwd"], "grpo_ext bwd": backward,
               "trl-triton bwd": steps["trl-triton bwd"]}  # fmt: skip
    return ordered, notes


def selective_truths(small: dict[str, Any], upstream: Tensor) -> dict[str, dict[str, Tensor]]:
    """Each selective peer's float64 truth on ``small`` (``upstream``: the backward's, for these rows)."""
    x64 = small["logits"].detach().double().requires_grad_(True)
    truth = reference.selective_log_softmax(x64, small["ids"], temperature=TEMPERATURE, return_entropy=True)
    grad = {"grad": torch.autograd.grad(truth.logps, x64, upstream.double())[0]}
    with torch.no_grad():
        loss = reference.grpo_loss_from_logits(x64, small["ids"], small["advantages"].double(), small["mask"],
                                               **kwargs64(small)).loss  # fmt: skip
    logps, entropy, kept = truth.logps.detach(), truth.entropy.detach(), small["mask"]
    plain = {"logps": logps, "entropy": entropy}
    masked = {"loss": loss, "logps": logps * kept, "entropy": entropy * kept}  # 0 at the tokens never read
    return {"grpo_ext fwd": plain, "trl-triton fwd": plain, "grpo_ext loss fwd": masked, "trl-triton+loss fwd": masked,
            "grpo_ext bwd": grad, "trl-triton bwd": grad}  # fmt: skip


def selective_case(rows_n: int, vocab: int, dtype: torch.dtype, device: torch.device, args) -> list[dict[str, Any]]:
    """The selective case's rows: its peers checked against float64, timed, each over its yardstick (read or copy)."""
    case = f"selective N={rows_n} V={vocab} {cli.dtype_name(dtype)}"
    inputs = draw_inputs(rows_n, vocab, None, dtype, device, args.seed)
    upstream = torch.randn(inputs["ids"].shape, device=device)
    steps, notes = selective_steps(inputs, upstream, device)
    small = first_rows(inputs, args.check_rows)
    small_upstream = upstream[: small["batch"]]
    small_steps, _ = selective_steps(small, small_upstream, device)
    truths = selective_truths(small, small_upstream)
    check(case, steps, notes, small_steps, truths.__getitem__, dtype, small["batch"] * small["length"])
    logits, out = inputs["logits"], torch.empty_like(inputs["logits"])
    steps = {"copy": lambda: out.copy_(logits)} | steps
    floors = {name: "copy" for name in steps if name == "copy" or name.endswith(" bwd")}
    rows = time_rows(case, steps, notes, floors, device, args.target_s)
    copy_ms = rows[0]["median_ms"]
    read = {"case": case, "impl": "read", "median_ms": copy_ms / 2 if copy_ms else None, "x_floor": None,
            "peak_mib": None, "note": "half a copy"}  # fmt: skip
    for row in rows:
        if row["impl"].endswith(" fwd") and row["median_ms"] and read["median_ms"]:
            row["x_floor"] = row["median_ms"] / read["median_ms"]
    return [rows[0], read, *rows[1:]]
