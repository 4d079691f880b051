"""Interleaved CPU timing of bench_grpo_loss_from_hidden.py's peers at one size, for a shared, loaded machine.

``bench_grpo_loss_from_hidden.py`` times one peer after another (about 30 s each at N=512, V=151936, H=512), so on
a shared machine a burst of load during one peer's window decides the comparison. Here every round calls each peer
once, in turn, after one untimed round, and the medians over the rounds are printed: load hits every peer alike.
The peers and inputs are the benchmark's (``make_steps``; ``--compile`` adds ``torch.compile`` of the reference,
its compilation untimed). Used for benchmarks/RESULTS.md's interleaved CPU hidden rows (issue 14 point 7).

Usage::

    python benchmarks/interleave_hidden.py 512x151936x512 --rounds 5 [--compile]
    # the Python layer of another checkout against the same kernels (its ``python/`` folder, _C copied into it):
    python benchmarks/interleave_hidden.py 512x151936x512 --before /tmp/old/python
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("size", help="NxVxH, e.g. 512x151936x512")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--compile", action="store_true", help="add torch.compile(reference) as a peer")
parser.add_argument("--before", default=None, help="import grpo_ext's Python layer from this folder instead")
args = parser.parse_args()
if args.before:  # ahead of the editable install's finder, which would otherwise win
    sys.meta_path = [f for f in sys.meta_path if "editable" not in (type(f).__module__ + repr(f)).lower()]
    sys.path.insert(0, args.before)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_grpo_loss_from_hidden as bench  # noqa: E402
import fused_loss  # noqa: E402
import grpo_ext  # noqa: E402
from logits_inputs import make_inputs  # noqa: E402

rows, vocab, size = (int(x) for x in args.size.split("x"))
device = torch.device("cpu")
inputs = make_inputs(rows, vocab, size, torch.float32, device, 0)
steps, notes = bench.make_steps(inputs, 0.04, device)
if args.compile:
    steps["compile"] = fused_loss.compiled_step(inputs, 0.04, "hidden")
steps = {name: step for name, step in steps.items() if step is not None}
print(f"grpo_ext from {Path(grpo_ext.__file__).parent}; n/a: {notes}")
for step in steps.values():  # warm-up round (compilation included)
    step()
times: dict[str, list[float]] = {name: [] for name in steps}
for _ in range(args.rounds):
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        times[name].append((time.perf_counter() - start) * 1e3)
eager = statistics.median(times["eager"])
for name, values in times.items():
    median = statistics.median(values)
    print(f"{args.size} {name:9s} median {median:9.0f} ms  eager/this {eager / median:5.2f}x  "
          f"all {[round(v) for v in values]}")  # fmt: skip
