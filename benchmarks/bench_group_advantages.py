"""Microbenchmark of group advantages: eager "TRL way" vs torch.compile(reference) vs grpo_ext.

Peers, timed side by side on the same rewards:
    * ``eager``: the advantages written the way TRL 1.16's ``GRPOTrainer`` writes them in eager PyTorch:
      ``rewards.view(-1, G)``, mean and std (Bessel) per group, ``repeat_interleave(G)``,
      ``(rewards - mean) / (std + 1e-4)``, and ``is_std_zero = isclose(std, 0)``.
    * ``compile``: ``torch.compile(grpo_ext.reference.group_advantages)``, compilation excluded from the timing;
      "n/a" with the reason when compiling fails on the machine.
    * ``grpo_ext``: ``grpo_ext.group_advantages(rewards, G)`` (one kernel launch), and on CUDA the same call
      captured in a CUDA graph and replayed (``grpo_ext+graph``).
    * ``grpo_ext+group_ids``: the same groups given as ``group_ids`` with the rows shuffled (a random permutation),
      the path of ragged or interleaved groups (a memset and three launches: count, place, then the advantages).

Before timing, every peer's advantages, group means and group stds (and zero-std flags) are checked against
``grpo_ext.reference.group_advantages`` run in float64 on the same rewards; a peer that disagrees is not timed: its
row is n/a with the reason (``harness.checks.check_peer``), and the run goes on.

Inputs: ``rewards [num_groups * G]`` float32, uniform in [0, 1), the first group constant (a zero-std group).

Bandwidth (CUDA): bytes that must move divided by the median time, with ``B = num_groups * G`` and
``NG = num_groups``::

    bytes = B*4             # rewards read once (float32)
          + B*4             # advantages written once (float32)
          + NG*4 + NG*4     # group_mean and group_std written once (float32)
          + NG*1            # zero_std written once (bool)
          + B*8             # grpo_ext+group_ids only: the int64 group_ids read once

``%copy`` is that bandwidth as a share of a device-to-device ``copy_`` of 1 GiB measured in the same run. At these
sizes (tens of KiB) the time is launch latency, not memory traffic; the column shows how far from the memory bound.
Peak memory (CUDA) is the allocator's peak during one call above what was allocated before it, outputs included.

Usage::

    python benchmarks/bench_group_advantages.py           # CPU: 1024 groups of 16 and 64 of 8; CUDA: the six below
    python benchmarks/bench_group_advantages.py --quick   # smoke run (CI)
    python benchmarks/bench_group_advantages.py --groups 4096x16
"""

from __future__ import annotations

import argparse
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

EPS = 1e-4  # TRL's constant, also grpo_ext's default
Outputs = tuple[Tensor, Tensor, Tensor, Tensor]


def trl_style_advantages(rewards: Tensor, group_size: int) -> Outputs:
    """Group-normalized advantages as TRL 1.16 computes them in eager PyTorch (``scale_rewards="group"``).

    Args:
        rewards: ``[B]`` summed rewards, the ``G`` completions of a prompt contiguous.
        group_size: ``G``.

    Returns:
        ``(advantages [B], group_mean [B/G], group_std [B/G], is_std_zero [B])``.
    """
    mean_grouped_rewards = rewards.view(-1, group_size).mean(dim=1)
    std_grouped_rewards = rewards.view(-1, group_size).std(dim=1)
    mean_rewards = mean_grouped_rewards.repeat_interleave(group_size, dim=0)
    std_rewards = std_grouped_rewards.repeat_interleave(group_size, dim=0)
    advantages = rewards - mean_rewards
    advantages = advantages / (std_rewards + EPS)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return advantages, mean_grouped_rewards, std_grouped_rewards, is_std_zero


def make_rewards(num_groups: int, group_size: int, device: torch.device, seed: int) -> Tensor:
    """Uniform float32 rewards, drawn on the CPU (same values on every device); group 0 is constant."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(num_groups * group_size, generator=gen)
    rewards[:group_size] = 0.5
    return rewards.to(device)


def bytes_moved(num_groups: int, group_size: int) -> int:
    """Bytes that must move (formula in the module docstring)."""
    batch = num_groups * group_size
    return batch * 4 + batch * 4 + num_groups * (4 + 4 + 1)


def run_case(
    num_groups: int,
    group_size: int,
    args: argparse.Namespace,
    device: torch.device,
    flusher: timing.L2Flusher | None,
) -> list[dict[str, Any]]:
    """Checks and times every peer on one case; returns one row per peer."""
    case = f"{num_groups} groups x G={group_size}"
    rewards = make_rewards(num_groups, group_size, device, seed=args.seed)

    def eager() -> Outputs:
        return trl_style_advantages(rewards, group_size)

    def ext() -> Outputs:
        return tuple(grpo_ext.group_advantages(rewards, group_size, eps=EPS))

    # The same groups as group_ids, rows shuffled: row perm[i] of the batch is row i here.
    perm = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(args.seed)).to(device)
    shuffled_rewards = rewards[perm]
    group_ids = (torch.arange(rewards.numel(), device=device) // group_size)[perm]

    def ext_group_ids() -> Outputs:
        return tuple(grpo_ext.group_advantages(shuffled_rewards, group_ids=group_ids, num_groups=num_groups, eps=EPS))

    def make_compiled() -> Callable[[], Outputs]:
        torch._dynamo.reset()  # a fresh, static-shape compile per case (and no recompile limit across cases)
        compiled = torch.compile(reference.group_advantages, dynamic=False)
        return lambda: tuple(compiled(rewards, group_size, eps=EPS))

    steps: dict[str, Callable[[], Outputs] | None] = {"eager": eager, "grpo_ext": ext,
                                                      "grpo_ext+group_ids": ext_group_ids}  # fmt: skip
    notes, graph_outputs, compile_s = peers.add_optional_peers(case, steps, make_compiled, device, args)

    # agreement with the float64 reference, before any timing: a peer that disagrees is an n/a row with the reason
    truth = reference.group_advantages(rewards.double(), group_size, eps=EPS)
    outputs = peers.outputs_of(steps, graph_outputs)
    max_err = 0.0
    for name, (adv, mean, std, zero_std) in outputs.items():
        if name == "grpo_ext+group_ids":  # back to the batch's row order
            adv = torch.empty_like(adv).index_copy_(0, perm, adv)
        if name == "eager":
            zero_std = zero_std[::group_size]  # TRL's flag is per row (repeated std); one per group

        def compare(name=name, adv=adv, mean=mean, std=std, zero_std=zero_std) -> float:
            err = max(checks.assert_matches(f"{case} {name} {what}", actual, expected, torch.float32)
                      for what, actual, expected in (("advantages", adv, truth.advantages),
                                                     ("group_mean", mean, truth.group_mean),
                                                     ("group_std", std, truth.group_std)))  # fmt: skip
            torch.testing.assert_close(zero_std.cpu(), truth.zero_std.cpu(), msg=lambda m: f"{case} {name}: {m}")
            return err

        max_err = max(max_err, checks.check_peer(name, steps, notes, compare, case) or 0.0)
    del outputs
    print(f"check {case}: {peers.available(steps)} match the float64 reference (max |err| {max_err:.1e})")

    base_row = {
        "case": case,
        "op": "group_advantages",
        "num_groups": num_groups,
        "G": group_size,
        "dtype": "float32",
        "bytes": bytes_moved(num_groups, group_size),
        "check_max_abs_err": max_err,
    }
    rows = peers.time_peers(
        steps, notes, base_row, device, target_s=args.target_s, flusher=flusher, compile_s=compile_s
    )
    for row in rows:  # the ragged path also reads its group_ids
        if row["impl"] == "grpo_ext+group_ids":
            row["bytes"] += group_ids.numel() * group_ids.element_size()
    return rows


def parse_args() -> argparse.Namespace:
    """Command line; ``--quick`` shrinks the sizes and the timing."""
    parser = cli.make_parser(__doc__)
    parser.add_argument("--groups", default=None, type=cli.sizes_arg(2),
                        help="num_groups x G pairs, e.g. 1024x16,64x8")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    """Runs every case, prints the table and writes the JSON record."""
    args = parse_args()
    device, env, copy, flusher = environment.start(args)
    if args.groups is None:
        # CUDA: the H100 findings' shapes (8 to 524,288 rewards); the CPU keeps to the two usual ones
        full = "8x8,64x16,1024x16,4096x16,8192x64,65536x8" if device.type == "cuda" else "1024x16,64x8"
        args.groups = "8x4" if args.quick else full
    if args.target_s is None:
        args.target_s = 0.02 if args.quick else 0.25

    rows: list[dict[str, Any]] = []
    for num_groups, group_size in cli.parse_sizes(args.groups, 2):
        rows.extend(run_case(num_groups, group_size, args, device, flusher))
    reporting.report(__file__, "group_advantages", rows, env, copy, args, device, flusher)


if __name__ == "__main__":
    main()
