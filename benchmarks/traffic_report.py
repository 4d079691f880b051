"""Bytes each op's CUDA kernels move at the benchmark shapes of ``benchmarks/RESULTS.md``, beside the floor (every
input read once, every output written once), counted by running the real kernels on the emulated device.

The counts come from tests/cuda_emu's traffic build (traffic.cpp: every global load and store of the compiled
kernels, by buffer) on a few rows or groups of each shape at its real V or T; per-row bytes are then scaled to the
full shape (each row is independent, so this is exact up to the per-launch constants). No GPU is needed.

Columns: ``floor``: each byte the op needs read once and each output written once (the distinct bytes each launch
read plus the bytes it wrote); ``all loads``: every thread's loads plus the writes, i.e. the fused pass' second read
of a row (from L2 or HBM) and the per-row scalars that every thread of a block loads (one broadcast on a GPU, so an
upper bound). Times are bytes / 3.35 TB/s (H100 SXM HBM3): what a GPU run should approach, not a measurement.

Usage::

    python benchmarks/traffic_report.py          # print the Markdown section (kernel_report.py appends it)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 3.35e12


def _device(**limits):
    """The emulated H100 (or other ``limits``: ``max_cluster=0`` keeps the fused pass on its two-read kernel)."""
    from cuda_emu.client import SCHEDULES, EmuDevice

    return EmuDevice(ROOT / "csrc", schedules=SCHEDULES[:1], variant="traffic", **limits)


def _count(device, op: str, *args) -> tuple[object, int, int]:
    """``op``'s outputs, its floor bytes (distinct reads + writes) and all its bytes (every load + writes)."""
    out = device.call(op, *args)
    floor = total = 0
    for launch in device.last_traffic:
        for access in launch.buffers.values():
            floor += access.distinct + access.written
            total += access.read + access.written
    return out, floor, total


def _logits(rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    return torch.randn(rows, vocab, generator=g).to(dtype), torch.randint(0, vocab, (rows,), generator=g)


def measure() -> list[tuple[str, float, float]]:
    """(case, floor bytes, all bytes) at the benchmark shapes."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))  # the harness and the tests' problem builders
    from conftest import make_loss_batch
    from cuda_emu.test_advantages import group_args
    from cuda_emu.test_logits import pass_args
    from cuda_emu.test_loss import forward_args

    device, two_read = _device(), _device(max_cluster=0)
    cases = []
    sample = 2  # rows counted per logits shape
    for n, vocab, dtype in ((8192, 151936, torch.bfloat16), (2048, 32000, torch.float32)):
        logits, ids = _logits(sample, vocab, dtype)
        logit = (1.0, 1.0, 0.0)  # temperature, logit_scale, logit_softcap (0: none)
        (logps, _, stats), f1, t1 = _count(device, "selective_log_softmax_forward", logits, ids, *logit, True)
        _, f2, t2 = _count(device, "selective_log_softmax_backward", torch.ones_like(logps), None, logits, ids, stats,
                           *logit)  # fmt: skip
        label = f"N={n}, V={vocab}, {str(dtype).removeprefix('torch.')}"
        cases.append((f"`selective_log_softmax` forward + backward, {label}", (f1 + f2) * n / sample,
                      (t1 + t2) * n / sample))  # fmt: skip
        args = pass_args(logits, ids, torch.ones(1), torch.ones(1, sample), loss_type="dapo")
        for path, on in (("single-read", device), ("two-read", two_read)):
            _, f, t = _count(on, "grpo_loss_from_logits_pass", *args)
            cases.append((f"`grpo_loss_from_logits` pass (forward + gradient), {path}, {label}, every row unmasked",
                          f * n / sample, t * n / sample))  # fmt: skip
    batch, seq_len = 256, 4096
    b = make_loss_batch(2, seq_len, group_size=2, dtype=torch.float32)
    b.mask[:] = True
    args = forward_args(b, dict(old_logps=b.old_logps, ref_logps=b.ref_logps, beta=0.04, loss_type="dapo"),
                        nan_under_mask=False)  # fmt: skip
    (_, _, grad_raw, grad_scale), f1, t1 = _count(device, "grpo_loss_forward", *args)
    _, f2, t2 = _count(device, "grpo_loss_backward", torch.tensor(1.0), grad_raw, grad_scale, torch.float32)
    cases.append((f"`grpo_loss` forward + backward, B={batch}, T={seq_len}, float32, old and ref given, full mask",
                  (f1 + f2) * batch / 2, (t1 + t2) * batch / 2))  # fmt: skip
    rewards = torch.rand(1024 * 16)
    _, f, t = _count(device, "group_advantages", *group_args(rewards, 16, ("group", "mean", "sum_then_normalize")))
    cases.append(("`group_advantages`, 1024 groups x G=16, float32", f, t))
    problems = device.close() + two_read.close()
    if problems:
        raise RuntimeError("\n".join(problems))
    return cases


def markdown(cases: list[tuple[str, float, float]]) -> str:
    def size(b: float) -> str:
        return f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.3f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"

    def time(b: float) -> str:
        us = b / HBM_BYTES_PER_S * 1e6
        return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"

    rows = ["| op and shape | floor | all loads + writes | all / floor | floor at 3.35 TB/s | all at 3.35 TB/s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, floor, total in cases:
        rows.append(f"| {name} | {size(floor)} | {size(total)} | {total / floor:.2f} | {time(floor)} | {time(total)} |")
    return (
        "## Memory traffic (counted on the emulated device)\n\n"
        "Generated by `python benchmarks/traffic_report.py` (part of `make kernel-report`): the real kernels run on "
        "the CPU (tests/cuda_emu, traffic build) on two rows of each logits shape, two sequences of the loss shape "
        "and the whole advantage shape; bytes scaled per row. `floor`: each input byte read once, each output "
        "written once. `all loads`: every thread's loads (the two-read fused pass' second read of each row; the "
        "single-read pass stages each row in shared memory, split over a cluster of blocks when it does not fit one, "
        "and takes its chosen logit from there; per-row scalars "
        "that all threads of a block load, one broadcast on a GPU) plus the writes (the fused pass writes a kept "
        "row's chosen entry twice: its loop's value, then the entry itself). "
        "`tests/cuda_emu/test_traffic.py` pins these per op.\n\n" + "\n".join(rows) + "\n"
    )


# The H100 benchmark's group_advantages shapes (prompts x G; bench_group_advantages.py on CUDA).
ADVANTAGE_SHAPES = ((8, 8), (64, 16), (1024, 16), (4096, 16), (8192, 64), (65536, 8))


def advantage_grids() -> str:
    """The launch plan of group_advantages at the benchmark shapes (the launcher's own choice, read on the emulated
    device): the grid grows with the groups."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))  # the emulated device's client
    device = _device()
    rows = ["| prompts x G | rewards | lanes per group | threads per block | blocks (tiles of groups) | launches, "
            "group std | launches, batch std or GDPO | launches, `group_ids` |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]  # fmt: skip
    for prompts, group_size in ADVANTAGE_SHAPES:
        plan = device.call("group_advantages_launch_plan", prompts * group_size, prompts, group_size, "group",
                           "sum_then_normalize", 0)  # fmt: skip
        threads, width, tiles, _ = (int(v) for v in plan)
        rows.append(f"| {prompts} x {group_size} | {prompts * group_size:,} | {width} | {threads} | {tiles:,} | 1 "
                    "kernel | memset + 2 kernels | memset + 2 kernels more |")  # fmt: skip
    problems = device.close()
    if problems:
        raise RuntimeError("\n".join(problems))
    return (
        "## `group_advantages` launch plan\n\n"
        "Generated by `python benchmarks/traffic_report.py` from the launcher's plan "
        "(`plan_group_advantages_launch`, csrc/cuda/group_advantages.cuh): a team of lanes per group, a block per "
        "tile of groups, so the grid grows with the groups (it was one block of 1024 threads before issue 31). "
        "`tests/cuda_emu/test_advantages.py` pins the plan and the launches of each mode.\n\n" + "\n".join(rows) + "\n"
    )


def main() -> int:
    print(markdown(measure()))
    print(advantage_grids())
    return 0


if __name__ == "__main__":
    sys.exit(main())
