"""Each streaming op against the memory floor, in one short run: the GPU session's table (issue 32's five shapes).

The inputs are drawn on the device (a 32768 x 151936 case would take a minute to draw on the host), so a whole run
takes well under two minutes on an H100. Cases and peers, each timed as forward + backward unless marked:

* ``logits N=.. V=.. dtype`` (``grpo_loss_from_logits``; ``[B, T, V]`` with ``T = min(N, 1024)``, prefix masks of
  random length (about half of the tokens kept), ``dapo``, beta 0.04, temperature 0.9, old and ref log-probs):
  ``copy`` (a device-to-device copy of the logits: the yardstick, one read and one write), ``grpo_ext`` (the
  default path: on CUDA the two-read pass), the other layouts of the pass on CUDA (``LAYOUTS``: the single-read
  pass, ``GRPO_EXT_LOGITS_SINGLE_READ=1``; the two-read pass with blocks of 512 threads; the single-read pass with
  two blocks per SM), ``grpo_ext+entropy`` (``entropy_coef=0.01``), ``liger``
  (``triton_grpo_loss``, CUDA only), ``compile`` (``torch.compile`` of the float reference, with ``--compile``).
* ``selective N=.. V=.. dtype``: ``grpo_ext fwd`` (log-probs and entropy, no autograd) against ``read`` (half a
  copy: one read of the logits), ``grpo_ext bwd`` (the gradient for a random upstream one) against ``copy``.
* ``hidden N=.. V=.. H=.. dtype`` (``grpo_loss_from_hidden``): ``gemm`` (the three GEMMs the path cannot avoid:
  ``hidden @ W.T``, ``g @ W``, ``g.T @ hidden``), ``grpo_ext`` (default chunk, the random prefix masks),
  ``grpo_ext/all-kept`` (every token kept: the GEMMs' own work), ``grpo_ext/all-kept chunk=N`` (one chunk) and
  ``grpo_ext/half-masked`` (the second half of every row masked: its GEMMs should take about half the time).

``x floor`` is a row's time over its yardstick (copy, read or gemm). Before timing, every peer of a case but
compile (it would compile again) is run on the case's first sequences (``--check-rows`` tokens) and compared with
``grpo_ext.reference`` in float64; a peer that disagrees is an n/a row with the reason, never a stopped run.
Timing: ``triton.testing.do_bench`` medians on CUDA (L2 flushed between calls), :func:`harness.timing.time_call` on
the CPU. Peak memory: the allocator's peak above what was allocated before one call.

Usage::

    python benchmarks/bench_floor.py                        # issue 32's shapes (CUDA), the selective and hidden cases
    python benchmarks/bench_floor.py --quick --device cpu   # smoke run (CI)
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

import fused_loss
import grpo_ext
from bench_grpo_loss_from_logits import liger_step
from grpo_ext import reference
from harness import checks, cli, environment, peers, reporting, timing
from logits_inputs import TEMPERATURE, first_rows, policy_logps

BETA = 0.04
ENTROPY_COEF = 0.01
# issue 32's table (the H100 figures of ../shared/gpu/H100-2026-11-26.md)
LOGITS_CASES = (
    "8192x151936:bfloat16,16384x32000:bfloat16,2048x262144:bfloat16,32768x151936:bfloat16,4096x151936:float32"
)
SELECTIVE_CASES = "8192x151936:bfloat16"
HIDDEN_CASES = "8192x151936x4096:bfloat16"
QUICK = {"logits": "64x96:float32,64x96:bfloat16", "selective": "64x96:bfloat16", "hidden": "64x96x32:float32"}

Step = Callable[[], Any]


def parse_cases(text: str, arity: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``"8192x151936:bfloat16,..."`` -> ``[((8192, 151936), torch.bfloat16), ...]``; ``"none"`` -> ``[]``."""
    if text.strip().lower() == "none":
        return []
    out = []
    for item in cli.parse_list(text):
        size, _, dtype = item.partition(":")
        out.append((cli.parse_sizes(size, arity)[0], cli.parse_dtype(dtype or "bfloat16")))
    return out


def draw_inputs(rows: int, vocab: int, size: int | None, dtype: torch.dtype, device: torch.device,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """The case's inputs drawn on ``device``: as ``logits_inputs.make_inputs`` (same shapes and laws), faster."""
    length = min(rows, 1024)
    batch = rows // length
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs: dict[str, Any] = {"batch": batch, "length": length}
    if size is None:
        logits = torch.empty(batch, length, vocab, device=device, dtype=dtype)
        inputs["logits"] = logits.normal_(0.0, 2.0, generator=gen)
    else:
        inputs["hidden"] = torch.randn(batch, length, size, device=device, generator=gen).to(dtype)
        inputs["weight"] = (torch.randn(vocab, size, device=device, generator=gen) / size**0.5).to(dtype)
    inputs["ids"] = torch.randint(0, vocab, (batch, length), device=device, generator=gen)
    logps = policy_logps(inputs)
    # Near the policy's own log-probs. The logits path's ratios straddle the clip range (spread 0.2); the hidden
    # path's stay inside it (spread 0.05): its bf16 logits differ from float64 ones by about 1e-2, enough to move a
    # token across a clip boundary, where the gradient jumps (a disagreement with the float64 check, not an error).
    spread = 0.2 if size is None else 0.05
    inputs["old_logps"] = logps + spread * torch.randn(batch, length, device=device, generator=gen)
    inputs["ref_logps"] = logps + spread * torch.randn(batch, length, device=device, generator=gen)
    inputs["advantages"] = torch.randn(batch, device=device, generator=gen)
    lengths = torch.randint(1, length + 1, (batch, 1), device=device, generator=gen)
    inputs["mask"] = (torch.arange(length, device=device) < lengths).to(torch.int32)
    return inputs


# The fused pass's layout candidates (csrc/cuda/grpo_loss_from_logits.cuh, with_layout_from_env), timed side by side.
LAYOUTS = {
    "grpo_ext/single-read": {"GRPO_EXT_LOGITS_SINGLE_READ": "1"},
    "grpo_ext/two-read 512": {"GRPO_EXT_LOGITS_THREADS": "512"},
    "grpo_ext/single-read 2 per SM": {
        "GRPO_EXT_LOGITS_SINGLE_READ": "1",
        "GRPO_EXT_LOGITS_RESIDENT_BLOCKS_PER_SM": "2",
    },
}


def logits_steps(inputs: dict[str, Any], device: torch.device, compile_: bool) -> tuple[dict[str, Step | None],
                                                                                         dict[str, str]]:  # fmt: skip
    """The logits case's peers on ``inputs``; each returns ``(loss, grad_logits)``."""
    leaf = inputs["logits"].detach().requires_grad_(True)
    ids, adv, mask, kwargs = inputs["ids"], inputs["advantages"], inputs["mask"], fused_loss.loss_kwargs(inputs, BETA)

    def fused(fn=grpo_ext.grpo_loss_from_logits, **extra):
        def step():
            loss = fn(leaf, ids, adv, mask, **kwargs, **extra).loss
            return loss, torch.autograd.grad(loss, leaf)[0]

        return step

    steps: dict[str, Step | None] = {"grpo_ext": fused()}
    notes: dict[str, str] = {}
    if device.type == "cuda":
        steps.update({name: peers.with_env(variables, fused()) for name, variables in LAYOUTS.items()})
    steps["grpo_ext+entropy"] = fused(entropy_coef=ENTROPY_COEF)
    steps["liger"], reason = liger_step(inputs, leaf, BETA, device)
    if reason:
        notes["liger"] = reason
    if compile_:
        steps["compile"] = fused(torch.compile(reference.grpo_loss_from_logits, dynamic=False))
    return steps, notes


def logits_truth(small: dict[str, Any], entropy: bool) -> tuple[Tensor, Tensor]:
    """Loss and gradient of the float64 reference on ``small``."""
    leaf = small["logits"].detach().double().requires_grad_(True)
    kwargs = {k: v.double() if isinstance(v, Tensor) else v for k, v in fused_loss.loss_kwargs(small, BETA).items()}
    extra = {"entropy_coef": ENTROPY_COEF} if entropy else {}
    loss = reference.grpo_loss_from_logits(leaf, small["ids"], small["advantages"].double(), small["mask"], **kwargs,
                                           **extra).loss  # fmt: skip
    return loss, torch.autograd.grad(loss, leaf)[0]


def check(case: str, steps: dict[str, Step | None], notes: dict[str, str], small_steps: dict[str, Step | None],
          truths: Callable[[str], tuple[Tensor, ...]], dtype: torch.dtype, rows: int) -> None:  # fmt: skip
    """Runs each peer on the small inputs against the float64 truth; a peer that disagrees becomes n/a."""
    errors = []
    for name, step in small_steps.items():
        if step is None or steps.get(name) is None:
            continue

        def compare(name=name, step=step) -> float:
            got, want = step(), truths(name)
            err = checks.assert_matches(f"{case} {name} loss", got[0], want[0], dtype, 1.0)
            for g, t in zip(got[1:], want[1:], strict=True):
                err = max(err, checks.assert_matches(f"{case} {name} grad", g, t, dtype))
            return err

        try:
            err = checks.check_peer(name, steps, notes, compare, case)
        except Exception as exc:  # a peer that cannot even run on this machine (e.g. a Triton compile error)
            steps[name], notes[name], err = None, f"failed: {peers.short_reason(exc)}", None
        if err is not None:
            errors.append(f"{name} {err:.1e}")
    print(f"check {case} on {rows} rows: " + (", ".join(errors) or "no peer agreed"), flush=True)


def time_ms(fn: Step, device: torch.device, target_s: float) -> float:
    """Median ms of one call: ``do_bench`` on CUDA (L2 flushed between calls), the harness' timer on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(25, int(target_s * 250)), rep=max(100, int(target_s * 1000)),
                              return_mode="median"))  # fmt: skip
    return timing.time_call(fn, device, target_s=target_s)["median_ms"]


def time_rows(case: str, steps: dict[str, Step | None], notes: dict[str, str], floors: dict[str, str],
              device: torch.device, target_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """One row per peer: median ms, peak MiB and ``x floor`` (time over the yardstick named in ``floors``)."""
    rows, times = [], {}
    for name, step in steps.items():
        row: dict[str, Any] = {"case": case, "impl": name, "median_ms": None, "x_floor": None, "peak_mib": None,
                               "note": notes.get(name)}  # fmt: skip
        if step is not None:
            try:
                step()  # compile, autotune, allocator
                peak = timing.peak_memory_above(step, device)
                row["peak_mib"] = peak / 2**20 if peak is not None else None
                row["median_ms"] = times[name] = time_ms(step, device, target_s)
            except Exception as exc:  # out of memory, a peer's own failure: the run goes on
                row["note"] = f"failed: {peers.short_reason(exc)}"
        rows.append(row)
    for row in rows:
        base = times.get(floors.get(row["impl"], ""))
        if base and row["median_ms"]:
            row["x_floor"] = row["median_ms"] / base
    return rows


def logits_case(rows_n: int, vocab: int, dtype: torch.dtype, device: torch.device, args) -> list[dict[str, Any]]:
    case = f"logits N={rows_n} V={vocab} {cli.dtype_name(dtype)}"
    inputs = draw_inputs(rows_n, vocab, None, dtype, device, args.seed)
    steps, notes = logits_steps(inputs, device, args.compile)
    small = first_rows(inputs, args.check_rows)
    small_steps, _ = logits_steps(small, device, False)
    small_steps.pop("compile", None)
    plain, entropy = logits_truth(small, False), logits_truth(small, True)
    check(case, steps, notes, small_steps, lambda name: entropy if name == "grpo_ext+entropy" else plain, dtype,
          small["batch"] * small["length"])  # fmt: skip
    logits, out = inputs["logits"], torch.empty_like(inputs["logits"])
    steps = {"copy": lambda: out.copy_(logits)} | steps
    return time_rows(case, steps, notes, {name: "copy" for name in steps}, device, args.target_s)


def selective_case(rows_n: int, vocab: int, dtype: torch.dtype, device: torch.device, args) -> list[dict[str, Any]]:
    case = f"selective N={rows_n} V={vocab} {cli.dtype_name(dtype)}"
    inputs = draw_inputs(rows_n, vocab, None, dtype, device, args.seed)
    leaf = inputs["logits"].detach().requires_grad_(True)
    upstream = torch.randn(inputs["ids"].shape, device=device)

    def forward(x=leaf, ids=inputs["ids"]):
        with torch.no_grad():
            return grpo_ext.selective_log_softmax(x, ids, temperature=TEMPERATURE, return_entropy=True)

    saved = grpo_ext.selective_log_softmax(leaf, inputs["ids"], temperature=TEMPERATURE)

    def backward():
        return torch.autograd.grad(saved.logps, leaf, upstream, retain_graph=True)[0]

    small = first_rows(inputs, args.check_rows)
    x64 = small["logits"].detach().double().requires_grad_(True)
    truth = reference.selective_log_softmax(x64, small["ids"], temperature=TEMPERATURE, return_entropy=True)
    truth_grad = torch.autograd.grad(truth.logps, x64, upstream[: small["batch"]].double())[0]
    keep = small["batch"]

    def compare() -> float:
        x = small["logits"].detach().requires_grad_(True)
        got = grpo_ext.selective_log_softmax(x, small["ids"], temperature=TEMPERATURE, return_entropy=True)
        grad = torch.autograd.grad(got.logps, x, upstream[:keep])[0]
        err = checks.assert_matches(f"{case} logps", got.logps, truth.logps, dtype)
        err = max(err, checks.assert_matches(f"{case} entropy", got.entropy, truth.entropy, dtype))
        return max(err, checks.assert_matches(f"{case} grad", grad, truth_grad, dtype))

    steps: dict[str, Step | None] = {"grpo_ext fwd": forward, "grpo_ext bwd": backward}
    notes: dict[str, str] = {}
    err = checks.check_peer("grpo_ext fwd", steps, notes, compare, case)
    if err is None:
        steps["grpo_ext bwd"], notes["grpo_ext bwd"] = None, notes["grpo_ext fwd"]
    print(f"check {case} on {keep * small['length']} rows: grpo_ext " + (f"{err:.1e}" if err is not None else "n/a"))
    logits, out = inputs["logits"], torch.empty_like(inputs["logits"])
    copy = {"copy": lambda: out.copy_(logits)}
    rows = time_rows(case, copy | steps, notes, {"copy": "copy", "grpo_ext bwd": "copy"}, device, args.target_s)
    copy_ms = rows[0]["median_ms"]
    read = {"case": case, "impl": "read", "median_ms": copy_ms / 2 if copy_ms else None, "x_floor": None,
            "peak_mib": None, "note": "half a copy"}  # fmt: skip
    for row in rows:
        if row["impl"] == "grpo_ext fwd" and row["median_ms"] and read["median_ms"]:
            row["x_floor"] = row["median_ms"] / read["median_ms"]
    return [rows[0], read, *rows[1:]]


def hidden_case(rows_n: int, vocab: int, size: int, dtype: torch.dtype, device: torch.device,
                args) -> list[dict[str, Any]]:  # fmt: skip
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

    steps: dict[str, Step | None] = {
        "gemm": gemm, "grpo_ext": fused(), "grpo_ext/all-kept": fused(mask=kept),
        f"grpo_ext/all-kept chunk={rows_n}": fused(mask=kept, chunk_size=rows_n),
        "grpo_ext/half-masked": fused(mask=half),
    }  # fmt: skip
    small = first_rows(inputs, args.check_rows)
    sh = small["hidden"].detach().requires_grad_(True)
    h64, w64 = sh.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    kwargs64 = {k: v.double() if isinstance(v, Tensor) else v for k, v in fused_loss.loss_kwargs(small, BETA).items()}
    truth = reference.grpo_loss_from_hidden(h64, w64, small["ids"], small["advantages"].double(), small["mask"],
                                            **kwargs64).loss  # fmt: skip
    truth_all = (truth, *torch.autograd.grad(truth, (h64, w64)))
    small_steps = {"grpo_ext": fused(sh, weight, small)}
    notes: dict[str, str] = {}
    check(case, steps, notes, small_steps, lambda name: truth_all, dtype, small["batch"] * small["length"])
    for name in ("grpo_ext/all-kept", f"grpo_ext/all-kept chunk={rows_n}", "grpo_ext/half-masked"):
        if steps["grpo_ext"] is None:
            steps[name], notes[name] = None, notes["grpo_ext"]
    return time_rows(case, steps, notes, {name: "gemm" for name in steps}, device, args.target_s)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("case", "case", "s"), ("impl", "impl", "s"), ("median_ms", "ms", "ms"), ("x_floor", "x floor", "x"),
            ("peak_mib", "peak MiB", "f1")]  # fmt: skip
    print(reporting.format_table(rows, cols))
    for row in rows:
        if row.get("note"):
            print(f"  {row['case']} {row['impl']}: {row['note']}")


def main() -> None:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--logits", default=None, help=f"NxV:dtype list (default {LOGITS_CASES}; 'none')")
    parser.add_argument("--selective", default=None, help=f"NxV:dtype list (default {SELECTIVE_CASES}; 'none')")
    parser.add_argument("--hidden", default=None, help=f"NxVxH:dtype list (default {HIDDEN_CASES}; 'none')")
    parser.add_argument("--check-rows", type=int, default=2048, help="tokens of the float64 check (whole sequences)")
    parser.add_argument("--compile", action="store_true", help="add the torch.compile peer to the logits cases")
    args = parser.parse_args()
    device = environment.resolve_device(args.device)
    if args.target_s is None:
        args.target_s = 0.05 if args.quick else 0.2
    for key, default in (("logits", LOGITS_CASES), ("selective", SELECTIVE_CASES), ("hidden", HIDDEN_CASES)):
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick or device.type != "cuda" else default)
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
    reporting.write_json(path, {"benchmark": "streaming ops against their floors", "environment": env,
                                "settings": {**settings, "timer": "do_bench_median" if device.type == "cuda"
                                             else "perf_counter_loop"}, "rows": rows})  # fmt: skip
    print(f"wrote {path}")
    print()
    print("median ms per call (forward + backward unless marked); x floor = time / its yardstick (copy, read, gemm)")
    print_table(rows)


if __name__ == "__main__":
    main()
