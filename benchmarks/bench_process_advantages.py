"""Microbenchmark of process-supervision advantages: eager reference vs torch.compile(reference) vs grpo_ext.

Peers, timed side by side on the same step rewards:
    * ``eager``: ``grpo_ext.reference.process_advantages`` in eager PyTorch. TRL 1.16 has no process-supervision
      advantages, so the plain PyTorch way is the reference itself: NaN-aware group mean and std over every valid
      step of the group, the normalized step rewards, then ``A[i, t] = sum_j rt[i, j] * (step_end[i, j] >= t)``
      through a ``[B, S, T]`` comparison and sum.
    * ``compile``: ``torch.compile(grpo_ext.reference.process_advantages)``, compilation excluded from the timing;
      "n/a" with the reason when compiling fails on the machine.
    * ``grpo_ext``: ``grpo_ext.process_advantages`` (one kernel), and on CUDA the same call captured in a CUDA graph
      and replayed (``grpo_ext+graph``).

The op has no backward (advantages are not differentiated): each call is the forward. Before timing, every peer's
``[B, T]`` advantages are checked against ``grpo_ext.reference.process_advantages`` run in float64 on the same
inputs; a peer that disagrees is not timed: its row is n/a with the reason.

Inputs: ``B = num_groups * G`` rows of ``S`` step slots. Row ``i`` has a number of steps uniform in ``[1, S]``; the
ends of its slots are ``S`` distinct sorted positions in ``[0, T)``, of which the first that many are its steps
(the rest is padding: end -1, reward NaN). Rewards are float32, uniform in [0, 1), those of group 0 constant (a
zero-std group).

Bandwidth (CUDA): bytes that must move divided by the median time::

    bytes = B*S*4   # step_rewards read once (float32)
          + B*S*8   # step_end read once (int64)
          + B*T*4   # advantages written once (float32)

``%copy`` is that bandwidth as a share of a device-to-device ``copy_`` of 1 GiB measured in the same run. Peak memory
(CUDA) is the allocator's peak during one call above what was allocated before it, outputs included.

Usage::

    python benchmarks/bench_process_advantages.py           # default sizes for the device
    python benchmarks/bench_process_advantages.py --quick   # smoke run (CI)
    python benchmarks/bench_process_advantages.py --sizes 64x16x32x4096
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness`, wherever the script is run from

import torch
from torch import Tensor

import grpo_ext
from grpo_ext import reference
from harness import checks, cli, environment, peers, reporting, timing

EPS = 1e-4  # grpo_ext's default, as in group_advantages


def make_inputs(
    num_groups: int, group_size: int, num_steps: int, seq_len: int, device: torch.device, seed: int
) -> tuple[Tensor, Tensor]:
    """Step rewards and step ends (see the module docstring), drawn on the CPU so every device gets the same values.

    Returns:
        ``(step_rewards [B, S] float32, step_end [B, S] int64)``.
    """
    if num_steps > seq_len:
        raise SystemExit(f"S={num_steps} steps cannot end at distinct positions of T={seq_len} tokens")
    batch = num_groups * group_size
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(batch, num_steps, generator=gen)
    rewards[:group_size] = 0.5
    ends = torch.rand(batch, seq_len, generator=gen).argsort(dim=1)[:, :num_steps].sort(dim=1).values
    counts = torch.randint(1, num_steps + 1, (batch, 1), generator=gen)
    valid = torch.arange(num_steps).unsqueeze(0) < counts
    rewards = torch.where(valid, rewards, torch.full_like(rewards, float("nan")))
    step_end = torch.where(valid, ends, torch.full_like(ends, -1))
    return rewards.to(device), step_end.to(device)


def bytes_moved(batch: int, num_steps: int, seq_len: int) -> int:
    """Bytes that must move (formula in the module docstring)."""
    return batch * num_steps * (4 + 8) + batch * seq_len * 4


def run_case(
    sizes: tuple[int, ...],
    args: argparse.Namespace,
    device: torch.device,
    flusher: timing.L2Flusher | None,
) -> list[dict[str, Any]]:
    """Checks and times every peer on one case (``num_groups, G, S, T``); returns one row per peer."""
    num_groups, group_size, num_steps, seq_len = sizes
    case = f"{num_groups} groups x G={group_size} S={num_steps} T={seq_len}"
    rewards, step_end = make_inputs(num_groups, group_size, num_steps, seq_len, device, seed=args.seed)

    def op_step(fn: Callable[..., Tensor]) -> Callable[[], Tensor]:
        return lambda: fn(rewards, step_end, group_size, seq_len, eps=EPS)

    def make_compiled() -> Callable[[], Tensor]:
        torch._dynamo.reset()  # a fresh, static-shape compile per case (and no recompile limit across cases)
        return op_step(torch.compile(reference.process_advantages, dynamic=False))

    steps: dict[str, Callable[[], Tensor] | None] = {
        "eager": op_step(reference.process_advantages),
        "grpo_ext": op_step(grpo_ext.process_advantages),
    }
    notes, graph_outputs, compile_s = peers.add_optional_peers(case, steps, make_compiled, device, args)

    # agreement with the float64 reference, before any timing: a peer that disagrees is an n/a row with the reason
    truth = reference.process_advantages(rewards.double(), step_end, group_size, seq_len, eps=EPS)
    outputs = peers.outputs_of(steps, graph_outputs)
    max_err = 0.0
    for name, advantages in outputs.items():
        compare = functools.partial(checks.assert_matches, f"{case} {name}", advantages, truth, torch.float32)
        err = checks.check_peer(name, steps, notes, compare, case)
        max_err = max(max_err, err or 0.0)
    del outputs
    print(f"check {case}: {peers.available(steps)} match the float64 reference (max |err| {max_err:.1e})")

    base_row = {
        "case": case,
        "op": "process_advantages",
        "num_groups": num_groups,
        "G": group_size,
        "S": num_steps,
        "T": seq_len,
        "dtype": "float32",
        "bytes": bytes_moved(num_groups * group_size, num_steps, seq_len),
        "check_max_abs_err": max_err,
    }
    return peers.time_peers(
        steps, notes, base_row, device, target_s=args.target_s, flusher=flusher, compile_s=compile_s
    )


def parse_args() -> argparse.Namespace:
    """Command line; ``--quick`` shrinks the sizes and the timing."""
    parser = cli.make_parser(__doc__)
    parser.add_argument("--sizes", default=None, type=cli.sizes_arg(4),
                        help="num_groups x G x S x T, e.g. 64x16x32x4096,16x16x32x1024 (S <= T)")  # fmt: skip
    args = parser.parse_args()
    if args.sizes is not None and any(steps > tokens for *_, steps, tokens in cli.parse_sizes(args.sizes, 4)):
        parser.error("argument --sizes: S steps cannot end at distinct positions of T < S tokens")
    return args


def main() -> None:
    """Runs every case, prints the table and writes the JSON record."""
    args = parse_args()
    device, env, copy, flusher = environment.start(args)
    if args.sizes is None:
        args.sizes = (
            "2x4x4x16" if args.quick else ("64x16x32x4096,16x16x32x1024" if device.type == "cuda" else "16x16x32x1024")
        )
    if args.target_s is None:
        args.target_s = 0.02 if args.quick else 0.25

    rows: list[dict[str, Any]] = []
    for sizes in cli.parse_sizes(args.sizes, 4):
        rows.extend(run_case(sizes, args, device, flusher))
    reporting.report(__file__, "process_advantages", rows, env, copy, args, device, flusher)


if __name__ == "__main__":
    main()
