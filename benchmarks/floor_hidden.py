"""``bench_floor.py``'s hidden cases: ``grpo_loss_from_hidden`` against the three GEMMs it cannot avoid, TRL 1.16's
chunked LM head, and its own chunk sweep (the ``hidden`` entry of ``bench_floor.py``'s docstring).
"""

from __future__ import annotations

from typing import Any

import torch

import fused_loss
import grpo_ext
from floor_common import BETA, SINGLE_READ, Step, check, draw_inputs, kwargs64, time_rows
from grpo_ext import reference
from grpo_ext.ops.grpo_loss_from_hidden import default_chunk_size
from harness import cli, peers
from logits_inputs import TEMPERATURE, first_rows
from trl_peers import trl_fused_head_step


def hidden_case(rows_n: int, vocab: int, size: int, dtype: torch.dtype, device: torch.device,
                args) -> list[dict[str, Any]]:  # fmt: skip
    """The hidden case's rows: its peers checked against float64, then timed against the three GEMMs."""
    case = f"hidden N={rows_n} V={vocab} H={size} {cli.dtype_name(dtype)}"
    inputs = draw_inputs(rows_n, vocab, size, dtype, device, args.seed)
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(True)
    kept = torch.ones_like(inputs["mask"])
    half = kept.clone()
    half[:, inputs["length"] // 2 :] = 0

    def fused(h=hidden, w=weight, ins=inputs, mask=None, **extra):
        def step():
            kept = ins["mask"] if mask is None else mask
            loss = grpo_ext.grpo_loss_from_hidden(h, w, ins["ids"], ins["advantages"], kept,
                                                  **fused_loss.loss_kwargs(ins, BETA), **extra).loss  # fmt: skip
            return (loss, *torch.autograd.grad(loss, (h, w)))

        return step

    flat_h = inputs["hidden"].reshape(-1, size)
    g = torch.randn(rows_n, vocab, device=device).to(dtype)

    def gemm():
        return flat_h @ inputs["weight"].t(), g @ inputs["weight"], g.t() @ flat_h

    notes: dict[str, str] = {}
    trl_step, reason = trl_fused_head_step(hidden, inputs["weight"], inputs, BETA)
    if reason:
        notes["trl-chunked"] = reason
    default_rows = default_chunk_size(flat_h, weight)  # the leaf the op differentiates
    sweep_rows = [r for r in dict.fromkeys((rows_n // 4, rows_n // 2, rows_n)) if r > 0 and r != default_rows]
    chunk_sweep = {f"grpo_ext/all-kept chunk={r}": fused(mask=kept, chunk_size=r) for r in sweep_rows}
    if device.type == "cuda":  # the head's floor at small H: one chunk and the single-read pass (NOTES.md, H 896)
        chunk_sweep[f"grpo_ext/all-kept chunk={rows_n} small-blocks"] = peers.with_env(
            SINGLE_READ, fused(mask=kept, chunk_size=rows_n))
    steps: dict[str, Step | None] = {
        "gemm": gemm, "grpo_ext": fused(), "trl-chunked": trl_step,
        f"grpo_ext/all-kept (chunk={default_rows})": fused(mask=kept), **chunk_sweep,
        "grpo_ext/half-masked": fused(mask=half),
    }  # fmt: skip
    small = first_rows(inputs, args.check_rows)
    sh = small["hidden"].detach().requires_grad_(True)
    h64, w64 = sh.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    truth = reference.grpo_loss_from_hidden(h64, w64, small["ids"], small["advantages"].double(), small["mask"],
                                            **kwargs64(small)).loss  # fmt: skip
    grad_hidden, grad_weight = torch.autograd.grad(truth, (h64, w64))
    truth_all = {"loss": truth, "grad hidden": grad_hidden, "grad weight": grad_weight}
    small_steps = {"grpo_ext": fused(sh, weight, small)}
    truths = {"grpo_ext": truth_all}
    if trl_step is not None:
        small_steps["trl-chunked"], _ = trl_fused_head_step(sh, inputs["weight"], small, BETA)
        with torch.no_grad():
            entropy = reference.selective_log_softmax(h64 @ w64.t(), small["ids"], temperature=TEMPERATURE,
                                                      return_entropy=True).entropy  # fmt: skip
        truths["trl-chunked"] = truth_all | {"entropy": entropy * small["mask"]}  # 0 where masked, as TRL's
    check(case, steps, notes, small_steps, truths.__getitem__, dtype, small["batch"] * small["length"])
    for name in (f"grpo_ext/all-kept (chunk={default_rows})", *chunk_sweep, "grpo_ext/half-masked"):
        if steps["grpo_ext"] is None:
            steps[name], notes[name] = None, notes["grpo_ext"]
    return time_rows(case, steps, notes, {name: "gemm" for name in steps}, device, args.target_s)
