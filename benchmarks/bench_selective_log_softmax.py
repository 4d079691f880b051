"""Microbenchmark of selective_log_softmax, forward + backward: eager "TRL way" vs torch.compile(reference) vs grpo_ext.

Peers, timed side by side on the same logits and ids:
    * ``eager``: the log-probs and entropy written the way TRL 1.16 computes them in eager PyTorch
      (``trl_style.trl_style_selective_log_softmax``): ``z = logits.float() / temperature``, the log-prob of the chosen
      id as ``z[id] - logsumexp(z)`` (the values of ``log_softmax(z).gather(...)``), and the entropy
      ``logsumexp(z) - sum softmax(z) * z`` under ``no_grad``, as TRL logs it as a metric.
    * ``compile``: ``torch.compile(grpo_ext.reference.selective_log_softmax)`` with ``return_entropy=True``,
      compilation excluded from the timing; "n/a" with the reason when compiling fails on the machine.
    * ``grpo_ext``: ``grpo_ext.selective_log_softmax(..., return_entropy=True)`` (one pass over each row forward, one
      backward that recomputes the softmax from the saved per-row statistics), and on CUDA the same call captured in a
      CUDA graph and replayed (``grpo_ext+graph``).

Each call computes the log-probs and the entropy, then the gradient of the log-probs w.r.t. the logits for a fixed
random upstream gradient (what a loss sends back; the entropy is a metric, not differentiated, as in TRL). Before
timing, every peer's log-probs, entropy and gradient on the first ``--check-rows`` rows are checked against
``grpo_ext.reference.selective_log_softmax`` run in float64 on those rows; a peer that disagrees is not timed: its row
is n/a with the reason (``harness.checks.check_peer``), and the run goes on.

Inputs (``logits_inputs.make_inputs``, the same logits as ``bench_grpo_loss_from_logits.py``): logits ``2 * randn``
in the case's dtype, ``[B, T, V]`` with ``B * T = N`` (``T`` the largest divisor of N up to 1024), random int64 ids,
temperature 0.9. The op has no mask: every row is read.

Bandwidth (CUDA): bytes that must move divided by the median time, with ``e`` bytes per logit::

    forward  = N*V*e      # logits read once
             + N*8        # ids read (int64)
             + N*4*2      # logps and entropy written (float32)
    backward = N*4        # the upstream gradient read
             + N*V*e      # logits read again (the softmax is recomputed, not stored)
             + N*V*e      # grad_logits written
    bytes    = forward + backward

``%copy`` is that bandwidth as a share of a device-to-device ``copy_`` of 1 GiB measured in the same run. Peak memory
(CUDA) is the allocator's peak during one call above what was allocated before it, outputs included.

Usage::

    python benchmarks/bench_selective_log_softmax.py           # default sizes for the device
    python benchmarks/bench_selective_log_softmax.py --quick   # smoke run (CI)
    python benchmarks/bench_selective_log_softmax.py --sizes 8192x151936 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and the shared modules, wherever run from

import torch
from torch import Tensor

import grpo_ext
from grpo_ext import reference
from harness import checks, cli, environment, peers, reporting, timing
from logits_inputs import LOGITS_SIZES, TEMPERATURE, fill_defaults, first_rows, make_inputs, make_parser
from trl_style import trl_style_selective_log_softmax

OUTPUTS = ("logps", "entropy", "grad")  # what a step returns, in order
Outputs = tuple[Tensor, Tensor, Tensor]
Step = Callable[[], Outputs]


def bytes_moved(rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Bytes that must move in forward + backward (formula in the module docstring)."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 3 * rows * vocab * elt + rows * (8 + 4 * 2 + 4)


def _step(fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], logits: Tensor, ids: Tensor, upstream: Tensor) -> Step:
    """A step running ``fn(logits, ids) -> (logps, entropy)``, then ``d (logps . upstream) / d logits``."""

    def step() -> Outputs:
        logps, entropy = fn(logits, ids)
        (grad,) = torch.autograd.grad(logps, logits, upstream)
        return logps.detach(), entropy.detach(), grad

    return step


def with_entropy(op: Callable[..., Any]) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``op(logits, ids)`` at the benchmark's temperature, with the entropy: grpo_ext's op or the reference."""
    return lambda logits, ids: op(logits, ids, temperature=TEMPERATURE, return_entropy=True)


def trl_way(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The eager peer: ``trl_style.trl_style_selective_log_softmax`` at the benchmark's temperature."""
    return trl_style_selective_log_softmax(logits, ids, TEMPERATURE)


def run_case(
    rows: int,
    vocab: int,
    dtype: torch.dtype,
    args: argparse.Namespace,
    device: torch.device,
    flusher: timing.L2Flusher | None,
) -> list[dict[str, Any]]:
    """Checks and times every peer on one case; returns one row per peer."""
    case = f"N={rows} V={vocab} {cli.dtype_name(dtype)}"
    inputs = make_inputs(rows, vocab, None, dtype, device, args.seed, loss_inputs=False)
    gen = torch.Generator().manual_seed(args.seed + 1)
    upstream = torch.randn(inputs["batch"], inputs["length"], generator=gen).to(device)
    leaf, ids = inputs["logits"].detach().requires_grad_(True), inputs["ids"]

    def make_compiled() -> Step:
        torch._dynamo.reset()  # a fresh, static-shape compile per case (and no recompile limit across cases)
        compiled = torch.compile(reference.selective_log_softmax, dynamic=False)
        return _step(with_entropy(compiled), leaf, ids, upstream)

    steps: dict[str, Step | None] = {
        "eager": _step(trl_way, leaf, ids, upstream),
        "grpo_ext": _step(with_entropy(grpo_ext.selective_log_softmax), leaf, ids, upstream),
    }
    notes, graph_outputs, compile_s = peers.add_optional_peers(case, steps, make_compiled, device, args)

    # agreement with the float64 reference on the first rows, before any timing: a peer that disagrees is an n/a
    # row. The op works row by row, so the first rows of a peer's outputs are its outputs on the first rows alone.
    small = first_rows(inputs, args.check_rows)
    keep = small["batch"]
    logits64 = small["logits"].detach().double().requires_grad_(True)
    truth = reference.selective_log_softmax(logits64, small["ids"], temperature=TEMPERATURE, return_entropy=True)
    (truth_grad,) = torch.autograd.grad(truth.logps, logits64, upstream[:keep].double())
    expected = (truth.logps.detach(), truth.entropy.detach(), truth_grad)
    outputs = peers.outputs_of(steps, graph_outputs, lambda out: tuple(t[:keep].clone() for t in out))
    max_err = dict.fromkeys(OUTPUTS, 0.0)
    for name, actual in outputs.items():

        def compare(name=name, actual=actual) -> dict[str, float]:
            return {what: checks.assert_matches(f"{case} {name} {what}", got, want, dtype)
                    for what, got, want in zip(OUTPUTS, actual, expected, strict=True)}  # fmt: skip

        errors = checks.check_peer(name, steps, notes, compare, case)
        for what, err in (errors or {}).items():
            max_err[what] = max(max_err[what], err)
    del outputs
    print(
        f"check {case} on {keep * inputs['length']} rows: {peers.available(steps)} match the float64 reference "
        f"(max |err| logps {max_err['logps']:.1e}, entropy {max_err['entropy']:.1e}, grad {max_err['grad']:.1e})"
    )

    base_row = {
        "case": case,
        "op": "selective_log_softmax fwd+bwd",
        "N": rows,
        "V": vocab,
        "dtype": cli.dtype_name(dtype),
        "temperature": TEMPERATURE,
        "bytes": bytes_moved(rows, vocab, dtype),
        "check_max_abs_err": max_err,
    }
    return peers.time_peers(
        steps, notes, base_row, device, target_s=args.target_s, flusher=flusher, compile_s=compile_s
    )


def main() -> None:
    """Runs every case, prints the table and writes the JSON record."""
    parser = make_parser(__doc__, "NxV pairs, e.g. 8192x151936")
    args = parser.parse_args()
    device, env, copy, flusher = environment.start(args)
    fill_defaults(args, device, LOGITS_SIZES)

    rows: list[dict[str, Any]] = []
    for dtype in map(cli.parse_dtype, cli.parse_list(args.dtypes)):
        for n, v in cli.parse_sizes(args.sizes, 2):
            rows.extend(run_case(n, v, dtype, args, device, flusher))
    reporting.report(__file__, "selective_log_softmax forward + backward", rows, env, copy, args, device, flusher)


if __name__ == "__main__":
    main()
