"""Each streaming op against the memory floor, in one short run: the GPU session's table (issue 32's five shapes).

The inputs are drawn on the device (a 32768 x 151936 case would take a minute to draw on the host), so a whole run
takes well under two minutes on an H100. The logits cases are here; the selective and hidden cases are in
``floor_selective.py`` and ``floor_hidden.py``, what all three share (inputs, the float64 check, the timer) in
``floor_common.py``. Cases and peers, each timed as forward + backward unless marked:

* ``logits N=.. V=.. dtype`` (``grpo_loss_from_logits``; ``[B, T, V]`` with ``B * T = N``, ``T`` the largest
  divisor of N up to 1024, prefix masks of random length (about half of the tokens kept), ``dapo``, beta 0.04,
  temperature 0.9, old and ref log-probs):
  ``copy`` (a device-to-device copy of the logits: the yardstick, one read and one write), ``grpo_ext`` (the
  default path: on CUDA the two-read pass, blocks of 256 threads for bf16 and 512 for float32), the other layouts of
  the pass on CUDA (``LAYOUTS``: the two-read pass with blocks of 1024 (the default before 2026-11-27) and of 512
  threads (GRPO_EXT_LOGITS_THREADS caps either dtype), and its 32-register build for bf16/fp16, 8 blocks of 256 an SM
  (``GRPO_EXT_LOGITS_FULL_OCCUPANCY=1``); the single-read pass in its small-block layout,
  ``GRPO_EXT_LOGITS_SINGLE_READ=1``: clusters of up to 16 blocks of 256 threads staging their parts with cp.async,
  with and without the entropy bonus, with blocks of 128 threads, and with persistent clusters,
  ``GRPO_EXT_LOGITS_PERSISTENT=1``), ``grpo_ext+entropy``
  (``entropy_coef=0.01``), ``liger`` (``triton_grpo_loss``, CUDA only), ``compile`` (``torch.compile`` of the float
  reference, with ``--compile``). Then the same shape ``every row kept`` (``copy``, ``grpo_ext``, its full-occupancy
  build, the small blocks,
  ``liger``) and ``every row masked`` (``copy``, ``grpo_ext``, the small blocks: no layout reads a masked row, so
  each should take about half a copy, its writes).
* ``selective N=.. V=.. dtype`` (the logits case's inputs): the ``fwd`` rows (no autograd) against ``read`` (half a
  copy: one read of the logits), the ``bwd`` rows (the log-probs' gradient for a random upstream one) against
  ``copy``. ``grpo_ext fwd`` (``selective_log_softmax``: log-probs and entropy) beside ``trl-triton fwd`` (TRL
  1.16's Triton log-prob + entropy kernel, ``trl.kernels.selective_log_softmax_and_entropy``); ``grpo_ext loss
  fwd`` (the fused pass's forward, ``grpo_loss_from_logits`` under ``no_grad``: loss, metrics and the per-token
  log-probs and entropies, masked rows never read) beside ``trl-triton+loss fwd`` (TRL's kernel with the mask as
  its ``row_mask``, then the loss ``GRPOTrainer`` computes from those log-probs and its entropy metric:
  :func:`trl_loss`); ``grpo_ext bwd`` beside ``trl-triton bwd``. The TRL rows need CUDA and TRL (n/a otherwise).
* ``hidden N=.. V=.. H=.. dtype`` (``grpo_loss_from_hidden``): ``gemm`` (the three GEMMs the path cannot avoid:
  ``hidden @ W.T``, ``g @ W``, ``g.T @ hidden``), ``grpo_ext`` (default chunk, the random prefix masks),
  ``trl-chunked`` (TRL 1.16's ``add_fused_lm_head`` path, as ``GRPOTrainer`` sets it up: its chunked log-probs
  and entropies, then :func:`trl_loss`; on the CPU, where it has no Triton, TRL projects every position, masked or
  not: compare it with ``grpo_ext/all-kept`` there), ``grpo_ext/all-kept`` (every token kept: the GEMMs' own work),
  ``grpo_ext/all-kept chunk=R`` for R = N/4, N/2 and N where R is not the default chunk (each chunk reads and writes
  the float32 ``[V, H]`` weight-gradient accumulator; one chunk has none: its time over the default's is the
  accumulator's cost, its peak the memory that buys it) and ``grpo_ext/half-masked`` (the second half of every row
  masked: its GEMMs should take about half the time); on CUDA also one chunk with the single-read pass
  (``small-blocks``), the head's floor at small H if that pass reaches its own.

``x floor`` is a row's time over its yardstick (copy, read or gemm). Last, issue 38 item 2's targets for the logits
pass, judged from these rows (``floor_targets.py``: met, missed or n/a per shape, the fastest layout named beside
the default; the issue sets them for an H100), also written to the JSON as ``targets``. Before timing, every peer of
a case but compile (it would compile again) is run on the case's first sequences (``--check-rows`` tokens) and
compared with ``grpo_ext.reference`` in float64; a peer that disagrees is an n/a row with the reason, never a
stopped run.
Timing: ``triton.testing.do_bench`` medians on CUDA (L2 flushed between calls), :func:`harness.timing.time_call` on
the CPU. Peak memory: the allocator's peak above what was allocated before one call.

Usage::

    python benchmarks/bench_floor.py                        # issue 32's shapes (CUDA), the selective and hidden cases
    python benchmarks/bench_floor.py --quick --device cpu   # smoke run (CI)
    python benchmarks/bench_floor.py --device cpu           # the CPU's sizes (``CPU``): a few minutes on 2 cores
    python benchmarks/bench_floor.py --logits 8192x151936:bfloat16 --selective none --hidden none
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness` and the shared modules, wherever run from

import torch
from torch import Tensor

import floor_common
import floor_targets
import fused_loss
import grpo_ext
from bench_grpo_loss_from_logits import liger_step
from floor_common import BETA, ENTROPY_COEF, SINGLE_READ, Step, check, draw_inputs, kwargs64, parse_cases, time_rows
from floor_hidden import hidden_case
from floor_selective import selective_case
from grpo_ext import reference
from harness import cli, environment, peers, reporting
from logits_inputs import first_rows

# issue 32's table (the H100 figures of ../shared/gpu/H100-2026-11-26.md)
LOGITS_CASES = (
    "8192x151936:bfloat16,16384x32000:bfloat16,2048x262144:bfloat16,32768x151936:bfloat16,4096x151936:float32"
)
SELECTIVE_CASES = "8192x151936:bfloat16"
# H 4096 (a 7B head: one chunk at N 8192) and Qwen2.5-0.5B's H 896, whose default chunks are 1024 rows (issue 39:
# the step's head + loss at 1.44x its GEMMs on an H200; the chunk sweep below tells the accumulator's share)
HIDDEN_CASES = "8192x151936x4096:bfloat16,8192x151936x896:bfloat16"
QUICK = {"logits": "64x96:float32,64x96:bfloat16", "selective": "64x96:bfloat16", "hidden": "64x96x32:float32"}
# The CPU's defaults: sizes where the CPU kernels, TRL's chunked path and the GEMMs do real work (a few minutes on 2
# cores, the float64 checks included).
CPU = {"logits": "512x32000:float32", "selective": "512x32000:float32", "hidden": "512x32000x512:float32"}


# The fused pass's layout candidates (csrc/cuda/grpo_loss_from_logits_row.cuh, with_layout_from_env), timed side
# by side.
LAYOUTS = {
    "grpo_ext/two-read 1024": {"GRPO_EXT_LOGITS_THREADS": "1024"},
    "grpo_ext/two-read 512": {"GRPO_EXT_LOGITS_THREADS": "512"},
    # the two-read kernel's 32-register build for bf16/fp16: 8 blocks of 256 threads an SM, twice the loads in flight
    "grpo_ext/two-read full occupancy": {"GRPO_EXT_LOGITS_FULL_OCCUPANCY": "1"},
    # issue 38: the single-read pass, clusters of up to 16 blocks of 256 threads, four blocks (of four rows) per SM
    "grpo_ext/small-blocks": SINGLE_READ,
    # blocks of 128 threads: twice the elements a thread, so half the per-row work per element (NOTES.md, "The logits
    # loops on the ncu counters")
    "grpo_ext/small-blocks 128": {"GRPO_EXT_LOGITS_SINGLE_READ": "1", "GRPO_EXT_LOGITS_THREADS": "128"},
    # the same with no more clusters than run at once, each over several rows (GRPO_EXT_LOGITS_PERSISTENT)
    "grpo_ext/small-blocks persistent": {"GRPO_EXT_LOGITS_SINGLE_READ": "1", "GRPO_EXT_LOGITS_PERSISTENT": "1"},
}


def logits_steps(inputs: dict[str, Any], device: torch.device, compile_: bool,
                 only: tuple[str, ...] | None = None) -> tuple[dict[str, Step | None], dict[str, str]]:  # fmt: skip
    """The logits case's peers on ``inputs`` (those in ``only`` when given); each returns ``(loss, grad_logits)``."""
    leaf = inputs["logits"].detach().requires_grad_(True)
    ids, adv, mask, kwargs = inputs["ids"], inputs["advantages"], inputs["mask"], fused_loss.loss_kwargs(inputs, BETA)

    def fused(fn=grpo_ext.grpo_loss_from_logits, **extra):
        def step():
            loss = fn(leaf, ids, adv, mask, **kwargs, **extra).loss
            return loss, torch.autograd.grad(loss, leaf)[0]

        return step

    def wanted(name: str) -> bool:  # a peer left out is never built (Liger's copies its logits)
        return only is None or name in only

    steps: dict[str, Step | None] = {"grpo_ext": fused()}
    notes: dict[str, str] = {}
    if device.type == "cuda":
        steps.update({name: peers.with_env(env, fused()) for name, env in LAYOUTS.items() if wanted(name)})
        # the bonus's cost in the new layout (issue 38: within 2% of the pass without it)
        if wanted("grpo_ext/small-blocks+entropy"):
            steps["grpo_ext/small-blocks+entropy"] = peers.with_env(LAYOUTS["grpo_ext/small-blocks"],
                                                                    fused(entropy_coef=ENTROPY_COEF))  # fmt: skip
    if wanted("grpo_ext+entropy"):
        steps["grpo_ext+entropy"] = fused(entropy_coef=ENTROPY_COEF)
    if wanted("liger"):
        steps["liger"], reason = liger_step(inputs, leaf, BETA, device)
        if reason:
            notes["liger"] = reason
    if compile_:
        steps["compile"] = fused(torch.compile(reference.grpo_loss_from_logits, dynamic=False))
    return steps, notes


def logits_truth(small: dict[str, Any], entropy: bool) -> dict[str, Tensor]:
    """Loss and gradient of the float64 reference on ``small``."""
    leaf = small["logits"].detach().double().requires_grad_(True)
    extra = {"entropy_coef": ENTROPY_COEF} if entropy else {}
    loss = reference.grpo_loss_from_logits(leaf, small["ids"], small["advantages"].double(), small["mask"],
                                           **kwargs64(small), **extra).loss  # fmt: skip
    return {"loss": loss, "grad": torch.autograd.grad(loss, leaf)[0]}


# Issue 38 item 2's other masks (floor_targets.py), each timed with fewer peers: every row kept (the single-read
# pass's bytes are then a copy's), and every row masked (no layout may read a masked row: writes only, half a copy).
MASK_VARIANTS: dict[str, tuple[Callable[[Tensor], Tensor], tuple[str, ...]]] = {
    floor_targets.ALL_KEPT: (torch.ones_like, ("grpo_ext", "grpo_ext/two-read full occupancy", "grpo_ext/small-blocks",
                                               "liger")),
    floor_targets.ALL_MASKED: (torch.zeros_like, ("grpo_ext", "grpo_ext/small-blocks")),
}


def logits_case(rows_n: int, vocab: int, dtype: torch.dtype, device: torch.device, args) -> list[dict[str, Any]]:
    """The logits shape with bench_floor's prefix masks (every peer), then with each of ``MASK_VARIANTS``."""
    case = f"logits N={rows_n} V={vocab} {cli.dtype_name(dtype)}"
    inputs = draw_inputs(rows_n, vocab, None, dtype, device, args.seed)
    rows = logits_rows(case, inputs, dtype, device, args, None)
    for variant, (mask_like, peers_kept) in MASK_VARIANTS.items():
        varied = inputs | {"mask": mask_like(inputs["mask"])}
        rows += logits_rows(f"{case} {variant}", varied, dtype, device, args, peers_kept)
    return rows


def logits_rows(case: str, inputs: dict[str, Any], dtype: torch.dtype, device: torch.device, args,
                only: tuple[str, ...] | None) -> list[dict[str, Any]]:  # fmt: skip
    """One logits case's rows: its peers (those in ``only`` when given) checked against float64, then timed."""
    steps, notes = logits_steps(inputs, device, args.compile and only is None, only)
    small = first_rows(inputs, args.check_rows)
    small_steps, _ = logits_steps(small, device, False, only)
    plain = logits_truth(small, False)
    entropy = logits_truth(small, True) if any(name.endswith("+entropy") for name in small_steps) else None
    check(case, steps, notes, small_steps, lambda name: entropy if name.endswith("+entropy") else plain, dtype,
          small["batch"] * small["length"])  # fmt: skip
    logits, out = inputs["logits"], torch.empty_like(inputs["logits"])
    steps = {"copy": lambda: out.copy_(logits)} | steps
    return time_rows(case, steps, notes, {name: "copy" for name in steps}, device, args.target_s)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("case", "case", "s"), ("impl", "impl", "s"), ("median_ms", "ms", "ms"), ("x_floor", "x floor", "x"),
            ("peak_mib", "peak MiB", "f1")]  # fmt: skip
    print(reporting.format_table(rows, cols))
    for row in rows:
        if row.get("note"):
            print(f"  {row['case']} {row['impl']}: {row['note']}")


def main() -> None:
    # do_bench flushes L2 before every call and there is no CUDA-graph row: of the shared options, --target-s only
    parser = cli.make_parser(__doc__, ("target-s",))
    parser.add_argument("--logits", default=None, type=floor_common.cases_arg(2),
                        help=f"NxV:dtype list (default {LOGITS_CASES}; 'none')")  # fmt: skip
    parser.add_argument("--selective", default=None, type=floor_common.cases_arg(2),
                        help=f"NxV:dtype list (default {SELECTIVE_CASES}; 'none')")  # fmt: skip
    parser.add_argument("--hidden", default=None, type=floor_common.cases_arg(3),
                        help=f"NxVxH:dtype list (default {HIDDEN_CASES}; 'none')")  # fmt: skip
    parser.add_argument("--check-rows", type=cli.positive_int, default=2048,
                        help="tokens of the float64 check (whole sequences)")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="add the torch.compile peer to the logits cases")
    # accepted as every op script accepts it (tests/test_benchmarks.py passes it to each); compile is opt-in here
    parser.add_argument("--no-compile", action="store_true",
                        help="ignored: the compile peer runs only with --compile")  # fmt: skip
    args = parser.parse_args()
    device = environment.resolve_device(args.device)
    if args.target_s is None:
        args.target_s = 0.05 if args.quick else 0.2
    for key, default in (("logits", LOGITS_CASES), ("selective", SELECTIVE_CASES), ("hidden", HIDDEN_CASES)):
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else (default if device.type == "cuda" else CPU[key]))
    env = environment.environment(device)
    print(f"device: {env['device_name']} | torch {env['torch_version']} | grpo_ext {grpo_ext.__version__}")
    rows: list[dict[str, Any]] = []
    for (n, v), dtype in parse_cases(args.logits, 2):
        rows += logits_case(n, v, dtype, device, args)
    for (n, v), dtype in parse_cases(args.selective, 2):
        rows += selective_case(n, v, dtype, device, args)
    for (n, v, h), dtype in parse_cases(args.hidden, 3):
        rows += hidden_case(n, v, h, dtype, device, args)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    path = reporting.output_path(__file__, device, args.quick, args.out)
    verdicts = floor_targets.judge(rows)
    reporting.write_json(path, {"benchmark": "streaming ops against their floors", "environment": env,
                                "settings": {**settings, "timer": "do_bench_median" if device.type == "cuda"
                                             else "perf_counter_loop"}, "rows": rows,
                                "targets": verdicts})  # fmt: skip
    print(f"wrote {path}")
    print()
    print("median ms per call (forward + backward unless marked); x floor = time / its yardstick (copy, read, gemm)")
    print_table(rows)
    if verdicts:
        print()
        print(f"issue 38 item 2's targets (set for an H100; this run: {env['device_name']})")
        print(floor_targets.format_verdicts(verdicts))


if __name__ == "__main__":
    main()
