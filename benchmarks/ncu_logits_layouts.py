"""One call of each logits-pass layout on ``bench_floor.py``'s inputs, inside the CUDA profiler's capture range, for
Nsight Compute: why a layout takes the time it does (achieved occupancy, DRAM throughput, where warps stall), which
``bench_floor.py``'s timings cannot say (benchmarks/NOTES.md, "The small-block layout on an H200").

Each layout (``bench_floor.LAYOUTS`` and the default) is run twice first, outside the capture range, then once inside
it, in the order printed, so that ``ncu --profile-from-start off`` profiles one pass kernel per layout::

    ncu --clock-control none --profile-from-start off \\
        --kernel-name 'regex:^grpo_loss_from_logits_(small_block_)?kernel$' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/ncu_logits_layouts.py            # gpu_session.sh profile

On the CPU (``--device cpu``) it runs the default path only: a smoke run of the script. ``--only default,NAME``
keeps some layouts (``default`` and ``bench_floor.LAYOUTS``' names): gpu_session.sh's source-level pass, which
counts each SASS instruction's executions for two layouts (``--page source --print-source sass``).
"""

from __future__ import annotations

import argparse

import torch

import bench_floor
import floor_common

DEFAULT = "default (two-read, 256 threads bf16, 512 float32)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="N, token rows (default 8192)")
    parser.add_argument("--vocab", type=int, default=151936, help="V (default 151936)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=None,
                        help="comma-separated layouts to run (default: all): 'default' and bench_floor.LAYOUTS' names")
    args = parser.parse_args()
    device = torch.device(args.device)
    inputs = floor_common.draw_inputs(args.rows, args.vocab, None, getattr(torch, args.dtype), device, seed=0)
    peers, _ = bench_floor.logits_steps(inputs, device, compile_=False)  # the layouts' steps as bench_floor times them
    steps = {DEFAULT: peers["grpo_ext"]}
    steps.update({name: peers[name] for name in bench_floor.LAYOUTS if name in peers})  # CUDA only
    if args.only is not None:
        wanted = {DEFAULT if name == "default" else name for name in args.only.split(",")}
        unknown = wanted - {DEFAULT, *bench_floor.LAYOUTS}
        if unknown:
            known = ["default", *bench_floor.LAYOUTS]
            parser.error(f"--only: unknown layouts {sorted(unknown)}; expected some of {known}")
        steps = {name: run for name, run in steps.items() if name in wanted}
    for run in steps.values():  # warm-up: allocations, the launcher's attribute settings
        run()
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    for order, (name, run) in enumerate(steps.items()):
        print(f"profiled launch {order}: {name}", flush=True)
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
