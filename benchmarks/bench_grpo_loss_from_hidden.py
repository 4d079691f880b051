"""Microbenchmark of the GRPO loss from hidden states, forward + backward: eager "TRL way", compile, Liger, grpo_ext.

Peers, side by side on the same inputs:

* ``eager``: TRL's way in eager PyTorch: ``logits = hidden @ weight.T``, then as on the logits path
  (``bench_grpo_loss_from_logits.py``): ``logits.float() / temperature``, log-softmax through ``logsumexp`` and a
  gather, the entropy under ``no_grad`` (``trl_style.trl_style_selective_log_softmax``), then the loss of
  ``trl_style.trl_style_loss``.
* ``compile``: ``torch.compile(grpo_ext.reference.grpo_loss_from_hidden)``, compilation excluded from the timing;
  "n/a" with the reason when compiling fails on the machine.
* ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss``, when ``liger-kernel`` is installed (on a CPU too: its
  chunked loss runs through torch.compile there); n/a with the reason otherwise.
* ``grpo_ext``: ``grpo_ext.grpo_loss_from_hidden``.

Each call computes the loss and its gradients w.r.t. hidden and weight. Before timing, every peer but compile is
checked against ``grpo_ext.reference.grpo_loss_from_hidden`` in float64 on the first rows of the same inputs
(``--check-rows``). Inputs (``logits_inputs.make_inputs``): hidden ``randn``, weight ``randn / sqrt(H)``, in the
case's dtype, random ids, ``old_logps`` and ``ref_logps`` near the policy's own log-probs, prefix masks of random
length, ``dapo``, temperature 0.9.

Padding case (after the others, on the first size and dtype): ``grpo_ext`` on the same inputs with every token
kept and with the second half of each row masked, timed in the same run, alternating round by round; the ratio of
the two times (best of the repetitions, and medians) shows that masked tokens cost no GEMM work (target: at most 0.6).

Master-weight case (last, on the first size): a float32 weight and hidden states under bfloat16 GEMMs (TRL's bf16
autocast), cast first against ``compute_dtype=torch.bfloat16``, alternating, each against the three bfloat16 GEMMs
into preallocated outputs.

Yardstick: the time of the three GEMMs the path cannot avoid (``hidden @ W.T``, ``g @ W``, ``g.T @ hidden``) is
measured in the same run, and ``x gemm`` is that time over the row's. Peak memory (CUDA): the allocator's peak above
what was allocated before the call.

Usage::

    python benchmarks/bench_grpo_loss_from_hidden.py           # default sizes for the device
    python benchmarks/bench_grpo_loss_from_hidden.py --quick   # smoke run (CI)
    python benchmarks/bench_grpo_loss_from_hidden.py --sizes 8192x151936x4096 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and the shared modules, wherever run from

import torch
from torch import Tensor

import fused_loss
import grpo_ext
from fused_loss import LOSS_TYPE, Step
from harness import cli, peers, timing
from logits_inputs import TEMPERATURE, make_inputs
from trl_style import EPSILON


def make_steps(inputs: dict[str, Any], beta: float, device: torch.device) -> tuple[dict[str, Step | None], dict]:
    """Every peer but compile on ``inputs``: ``(steps, notes)``; a step returns ``(loss, grad_hidden, grad_weight)``."""
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(True)

    def eager():
        loss = fused_loss.eager_loss(hidden @ weight.t(), inputs, beta)
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    fused = fused_loss.loss_step(grpo_ext.grpo_loss_from_hidden, (hidden, weight), inputs, beta)
    steps: dict[str, Step | None] = {"eager": eager, "grpo_ext": fused}
    notes: dict[str, str] = {}
    steps["liger"], reason = liger_step(inputs, hidden, weight, beta, device)
    if reason:
        notes["liger"] = reason
    return steps, notes


def liger_step(inputs: dict[str, Any], hidden: Tensor, weight: Tensor, beta: float, device: torch.device):
    """Liger-Kernel's LigerFusedLinearGRPOLoss, or (None, why). On a CPU its chunked loss runs through
    torch.compile (Liger compiles each chunk's forward and backward; no Triton)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:
        return None, f"liger-kernel unavailable ({peers.short_reason(exc)}); pip install liger-kernel"
    try:
        loss_fn = LigerFusedLinearGRPOLoss(
            beta=beta, epsilon_low=EPSILON, epsilon_high=EPSILON, temperature=TEMPERATURE, loss_type=LOSS_TYPE,
            use_ref_model=beta != 0.0,  # Liger adds the KL term only with a reference model (here: ref_logps given)
        )
    except TypeError as exc:
        return None, f"LigerFusedLinearGRPOLoss's signature differs: {peers.short_reason(exc)}"

    def step():
        out = loss_fn(hidden, weight, inputs["ids"], inputs["mask"], inputs["advantages"],
                      ref_per_token_logps=inputs["ref_logps"], old_per_token_logps=inputs["old_logps"])  # fmt: skip
        loss = out[0] if isinstance(out, tuple) else out
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    return step, None


def gemm_time(inputs: dict[str, Any], device: torch.device, target_s: float, flusher) -> float:
    """Milliseconds of the hidden path's three GEMMs at this size, timed in this run."""
    hidden = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1])
    weight = inputs["weight"]
    logits = hidden @ weight.t()
    total = 0.0
    for fn in (lambda: hidden @ weight.t(), lambda: logits @ weight, lambda: logits.t() @ hidden):
        total += timing.time_call(fn, device, target_s=target_s / 3, flusher=flusher)["median_ms"]
    return total


#: The padding case's target: half the tokens masked take at most this share of the all-kept time.
PADDING_TARGET = 0.6
#: Rounds of the padding and master-weight cases: each times every call of the case, one after the other.
PADDING_ROUNDS = 5


def alternating_times(steps: list, device: torch.device, target_s: float, flusher) -> list[dict[str, Any]]:
    """``min_ms``, ``median_ms`` and ``reps`` of each step, timed in PADDING_ROUNDS rounds that run every step once
    in turn, so that a change of load on the machine hits them all alike."""
    rounds = [[timing.time_call(step, device, target_s=target_s / PADDING_ROUNDS, flusher=flusher)
               for step in steps] for _ in range(PADDING_ROUNDS)]  # fmt: skip
    return [{"min_ms": min(timed[index]["min_ms"] for timed in rounds),
             "median_ms": statistics.median(timed[index]["median_ms"] for timed in rounds),
             "reps": sum(timed[index]["reps"] for timed in rounds)} for index in range(len(steps))]  # fmt: skip


def padding_case(args: argparse.Namespace, device: torch.device, flusher) -> list[dict[str, Any]]:
    """grpo_ext with every token kept, then with the second half of each row masked (same hidden states, weight,
    ids and loss inputs), timed in this run: one row each, and the ratio of their times printed."""
    rows, vocab, size = cli.parse_sizes(args.sizes, 3)[0]
    dtype = cli.parse_dtype(cli.parse_list(args.dtypes)[0])
    inputs = make_inputs(rows, vocab, size, dtype, device, args.seed)
    length = inputs["length"]
    half = (torch.arange(length, device=device) < length // 2).expand(inputs["batch"], length)
    leaves = (inputs["hidden"].detach().requires_grad_(True), inputs["weight"].detach().requires_grad_(True))
    case = f"hidden N={rows} V={vocab} H={size} {cli.dtype_name(dtype)}"
    out, steps = [], []
    for label, mask in (("all kept", torch.ones_like(inputs["mask"])), ("half masked", half.to(inputs["mask"].dtype))):
        steps.append(fused_loss.loss_step(grpo_ext.grpo_loss_from_hidden, leaves, {**inputs, "mask": mask}, args.beta))
        out.append({"case": f"{case} {label}", "op": "grpo_loss_from_hidden fwd+bwd", "impl": "grpo_ext", "N": rows,
                    "V": vocab, "H": size, "dtype": cli.dtype_name(dtype), "kept_tokens": int((mask != 0).sum()),
                    "bytes": 0})  # fmt: skip
    for row, times in zip(out, alternating_times(steps, device, args.target_s, flusher), strict=True):
        row.update(times)
    full, masked = out
    best, median = masked["min_ms"] / full["min_ms"], masked["median_ms"] / full["median_ms"]
    masked["ratio_to_all_kept"] = best
    verdict = "meets" if best <= PADDING_TARGET else "MISSES"
    print(f"padding {case}: all kept {full['min_ms']:.3g} ms, half masked {masked['min_ms']:.3g} ms (best of "
          f"{masked['reps']}, alternating): ratio {best:.2f} (medians {median:.2f}); {verdict} the target <= "
          f"{PADDING_TARGET}")  # fmt: skip
    return out


def master_weight_case(args: argparse.Namespace, device: torch.device, flusher) -> list[dict[str, Any]]:
    """A float32 weight and hidden states under bfloat16 GEMMs, as TRL's bf16 autocast runs the head, on the first
    size with every token kept: ``cast first`` (``.to(torch.bfloat16)`` under autograd, which casts the gradients
    back) against ``compute_dtype=torch.bfloat16`` (the op casts; one chunk: in the weight gradient's buffer),
    alternating round by round, each also against the three bfloat16 GEMMs into preallocated outputs (the floor
    no head can beat), timed in the same rounds."""
    rows, vocab, size = cli.parse_sizes(args.sizes, 3)[0]
    inputs = make_inputs(rows, vocab, size, torch.float32, device, args.seed)
    inputs = {**inputs, "mask": torch.ones_like(inputs["mask"])}
    leaves = (inputs["hidden"].detach().requires_grad_(True), inputs["weight"].detach().requires_grad_(True))
    low = torch.bfloat16

    def cast_first(hidden, weight, *rest, **kwargs):
        return grpo_ext.grpo_loss_from_hidden(hidden.to(low), weight.to(low), *rest, **kwargs)

    def compute_dtype(*args, **kwargs):
        return grpo_ext.grpo_loss_from_hidden(*args, compute_dtype=low, **kwargs)

    case = f"hidden N={rows} V={vocab} H={size} float32 weight, bfloat16 GEMMs"
    steps = [fused_loss.loss_step(fn, leaves, inputs, args.beta) for fn in (cast_first, compute_dtype)]
    steps.append(timing.lm_head_gemms(rows, size, vocab, low, device))
    # the third row is plain torch.mm (timing.lm_head_gemms), not grpo_ext: its own impl name
    op = "grpo_loss_from_hidden fwd+bwd"
    labels = (("cast first", "grpo_ext", op), ("compute_dtype", "grpo_ext", op),
              ("3 GEMMs", "torch GEMMs (floor)", "LM head's 3 GEMMs"))  # fmt: skip
    times = alternating_times(steps, device, args.target_s, flusher)
    out = [{"case": f"{case} {label}", "op": op_name, "impl": impl, "N": rows, "V": vocab, "H": size,
            "dtype": "float32/bfloat16", "bytes": 0, **timed}
           for (label, impl, op_name), timed in zip(labels, times, strict=True)]  # fmt: skip
    floor = out[2]["median_ms"]
    for row in out[:2]:
        row["x_gemm"] = floor / row["median_ms"]
    print(f"master weight {case}: cast first {out[0]['median_ms']:.4g} ms ({1 / out[0]['x_gemm']:.3f}x the GEMMs), "
          f"compute_dtype {out[1]['median_ms']:.4g} ms ({1 / out[1]['x_gemm']:.3f}x), the 3 GEMMs {floor:.4g} ms "
          f"(medians of {PADDING_ROUNDS} alternating rounds)")  # fmt: skip
    return out


def extra_cases(args: argparse.Namespace, device: torch.device, flusher) -> list[dict[str, Any]]:
    return padding_case(args, device, flusher) + master_weight_case(args, device, flusher)


if __name__ == "__main__":
    fused_loss.main(__file__, __doc__, "hidden", make_steps, gemm_time, extra_cases)
