"""How much the demo's outcome depends on the CPU's float path and the seed: a grid of ``make demo`` runs.

Each cell is one ``run_demo`` in its own process with ``ATEN_CPU_CAPABILITY`` set (torch's and grpo_ext's CPU
kernels pick their ISA copy from it at load time), so the rounding differs between columns the way it differs
between machines. Every run goes to its step cap (``max_time_s`` off), so a busy machine changes the wall times,
never the outcome. The table gives the held-out greedy accuracy after training, the reward (first 5% -> last 10% of
the steps) and the wall time per cell, then the spread. Exit status 1 when a cell did not reach ``--min-accuracy``.

Usage (about 9 x 2 minutes of CPU; ``--jobs 2 --num-threads 1`` halves the wall time on 2 cores, and the wall
times are then those of 1 thread under load, not the ``make demo`` ones)::

    python examples/demo_spread.py                        # 3 capabilities x seeds 0, 1, 2, the demo's defaults
    python examples/demo_spread.py --jobs 2 --num-threads 1
    python examples/demo_spread.py --set learning_rate=1e-3 --seeds 0 --capabilities default avx2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CAPABILITIES = ("default", "avx2", "unset")  # "unset": the best ISA the CPU has (AVX-512 where present)

# One cell, run as ``python -c`` in a child: the overrides arrive as JSON, the result leaves as JSON on stdout's last
# line (the trainer prints its own lines before it).
_CHILD = """
import dataclasses, json, sys
from grpo_ext.trainer.demo import run_demo
args = json.loads(sys.argv[1])
result = run_demo(num_threads=args.pop("num_threads"), verbose=False, **args)
print(json.dumps({**dataclasses.asdict(result), "learned": result.learned}))
"""


def parse_override(text: str) -> tuple[str, Any]:
    """``"key=value"`` with the value read as JSON where it parses (numbers, true/false/null), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_cell(capability: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One demo run under ``capability`` with ``seed``; returns its DemoResult fields (or ``error``)."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != "unset":
        env["ATEN_CPU_CAPABILITY"] = capability
    options = {
        "num_threads": args.num_threads, "seed": seed, "output_dir": str(root / f"{capability}-seed{seed}"),
        "max_time_s": None, "disable_tqdm": True, "log_completions": False, "plot": False, **dict(args.set),
    }  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(options)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return {"capability": capability, "seed": seed, "error": proc.stderr.strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(capability=capability, seed=seed, process_time_s=time.perf_counter() - start)
    return result


def format_table(results: list[dict[str, Any]], capabilities: list[str], seeds: list[int]) -> str:
    """Rows: seeds; columns: capabilities; each cell ``accuracy% (reward first -> last, wall s)``."""
    by_cell = {(r["capability"], r["seed"]): r for r in results}

    def cell(capability: str, seed: int) -> str:
        r = by_cell[(capability, seed)]
        if "error" in r:
            return f"error: {r['error']}"
        return (
            f"{100 * r['accuracy_after']:5.1f}% ({r['reward_first']:.2f} -> {r['reward_last']:.2f}, "
            f"{r['steps']} steps, {r['wall_time_s']:.0f} s)"
        )

    header = ["seed", *[f"ATEN_CPU_CAPABILITY={c}" for c in capabilities]]
    rows = [[str(seed), *[cell(c, seed) for c in capabilities]] for seed in seeds]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capabilities", nargs="+", default=list(CAPABILITIES), choices=CAPABILITIES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1: honest wall times)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads per run (make demo: 2)")
    parser.add_argument("--set", type=parse_override, action="append", default=[], metavar="KEY=VALUE",
                        help="a GRPOConfig override for every run (repeatable)")  # fmt: skip
    parser.add_argument("--min-accuracy", type=float, default=0.85, help="held-out accuracy every cell must reach")
    parser.add_argument("--json", type=Path, default=None, help="also write every cell's result to this file")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders (metrics.jsonl) under this one")
    args = parser.parse_args(argv)

    cells = [(c, s) for s in args.seeds for c in args.capabilities]
    with tempfile.TemporaryDirectory(prefix="demo_spread_") as scratch:
        root = args.keep or Path(scratch)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda cell: run_cell(*cell, args, root), cells))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))

    print(format_table(results, args.capabilities, args.seeds))
    finished = [r for r in results if "error" not in r]
    if finished:
        accuracies = [100 * r["accuracy_after"] for r in finished]
        walls = [r["wall_time_s"] for r in finished]
        print(
            f"held-out accuracy: min {min(accuracies):.1f}%, median {statistics.median(accuracies):.1f}%, "
            f"max {max(accuracies):.1f}%; wall time {min(walls):.0f}-{max(walls):.0f} s "
            f"({args.jobs} run(s) at a time, {args.num_threads} thread(s) each)"
        )
    failed = [r for r in results if "error" in r or r["accuracy_after"] < args.min_accuracy]
    if failed:
        print(f"{len(failed)} of {len(results)} runs below {100 * args.min_accuracy:.0f}% held-out accuracy or failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
