"""Shared helpers of the grpo_ext microbenchmarks: timing, checks, device facts, bandwidth, tables and JSON.

The bench scripts import this module after putting their own folder on ``sys.path``, so they run from the repo
root (``python benchmarks/bench_grpo_loss.py``) and from anywhere by absolute path.

Timing method:
    * CUDA: each repetition first overwrites a buffer several times the L2 size (so inputs come from HBM, as in a
      training step where they were written long before), synchronizes, then records a ``torch.cuda.Event`` pair
      around one call. The GPU is idle when the start event fires, so the time includes the host-side cost of the
      call (Python, dispatcher, kernel launches) that the GPU waits on: the latency of one isolated call. CUDA-graph
      replay removes most of that host cost, which is why it is reported as its own row. The median over many
      repetitions is reported.
    * CPU: ``time.perf_counter`` around a loop of calls sized to last about 1 ms, repeated to fill a time budget;
      the median per-call time is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"
COPY_BYTES = 1 << 30  # 1 GiB source for the device-to-device copy that sets the bandwidth yardstick

# Tolerances of the agreement checks, against a float64 reference run on the same (upcast) inputs. bf16 is loose
# because the eager "TRL way" does its arithmetic in bf16 (exp, min, the masked sums and their autograd).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-4, "atol_rel": 1e-4},
    torch.bfloat16: {"rtol": 3e-2, "atol_rel": 3e-2},
    torch.float16: {"rtol": 1e-2, "atol_rel": 1e-2},
    torch.float64: {"rtol": 1e-7, "atol_rel": 1e-7},
}


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Adds the options every bench script shares.

    Args:
        parser: the script's parser.
    """
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short timing: a smoke run for CI")
    parser.add_argument(
        "--target-s", type=float, default=None, help="seconds of timed calls per implementation and case"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (reported n/a)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay row")
    parser.add_argument("--no-l2-flush", action="store_true", help="CUDA: keep L2 warm between repetitions")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/out/<script>-<dev>.json)")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """Parses ``"64x1024,256x4096"`` into ``[(64, 1024), (256, 4096)]``.

    Args:
        text: comma-separated ``AxB`` pairs of positive integers.

    Returns:
        The pairs, in order.
    """
    pairs = []
    for item in text.split(","):
        a, b = item.lower().split("x")
        pairs.append((int(a), int(b)))
    return pairs


def parse_list(text: str) -> list[str]:
    """Splits a comma-separated option value, dropping empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_dtype(name: str) -> torch.dtype:
    """Maps ``float32``/``fp32``/``bfloat16``/``bf16``/``float16``/``fp16``/``float64`` to a torch dtype."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def resolve_device(name: str | None) -> torch.device:
    """Returns the device to benchmark on: ``name``, or CUDA when available, else CPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------------
# device facts
# ---------------------------------------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    """Facts about the machine and the software, for the JSON record.

    Args:
        device: the benchmarked device.

    Returns:
        A JSON-ready dict: device name, torch/CUDA versions, UTC date, ``grpo_ext.build_info()`` and more.
    """
    import grpo_ext

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_type": device.type,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "torch_num_threads": torch.get_num_threads(),
        "grpo_ext_build_info": grpo_ext.build_info(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        info["total_memory_bytes"] = props.total_memory
        info["l2_cache_bytes"] = getattr(props, "L2_cache_size", None)
    else:
        info["device_name"] = info["cpu"]
    try:
        import triton

        info["triton_version"] = triton.__version__
    except Exception:  # triton is optional; its absence only matters to torch.compile on CUDA
        info["triton_version"] = None
    return info


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------


class L2Flusher:
    """Overwrites a buffer larger than the L2 cache, so the next kernel reads its inputs from HBM."""

    def __init__(self, device: torch.device) -> None:
        """Allocates the buffer: four times the L2 size, at least 64 MiB.

        Args:
            device: a CUDA device.
        """
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
        self.buffer = torch.empty(max(4 * l2, 64 << 20), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        """Evicts the L2 cache (asynchronously, on the current stream)."""
        self.buffer.zero_()


def time_cuda(
    fn: Callable[[], Any],
    *,
    target_s: float,
    min_reps: int = 50,
    max_reps: int = 2000,
    warmup: int = 5,
    flusher: L2Flusher | None = None,
) -> dict[str, Any]:
    """Median latency of one isolated call on CUDA, timed with CUDA events (see the module docstring).

    Args:
        fn: the call to time (its result is discarded).
        target_s: approximate total of timed seconds.
        min_reps: at least this many repetitions.
        max_reps: at most this many repetitions.
        warmup: untimed calls first (allocator, autotuning, lazy initialization).
        flusher: evicts L2 before each repetition; None keeps the cache warm.

    Returns:
        ``{"median_ms", "min_ms", "reps"}``.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    probe = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = max((time.perf_counter() - probe) / 3, 1e-6)
    reps = int(min(max(target_s / per_call, min_reps), max_reps))

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if flusher is not None:
            flusher()
        torch.cuda.synchronize()  # the call starts on an idle GPU: its host cost is part of its latency
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def time_cpu(fn: Callable[[], Any], *, target_s: float, warmup: int = 3, min_samples: int = 5) -> dict[str, Any]:
    """Median per-call time on CPU with ``time.perf_counter``.

    Each sample times a loop of calls lasting about 1 ms (so the timer's own cost does not count); samples are taken
    until ``target_s`` is spent.

    Args:
        fn: the call to time.
        target_s: approximate total of timed seconds.
        warmup: untimed calls first.
        min_samples: at least this many samples.

    Returns:
        ``{"median_ms", "min_ms", "reps"}`` with ``reps`` the total number of timed calls.
    """
    for _ in range(warmup):
        fn()
    probe = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - probe, 1e-7)
    inner = max(1, int(1e-3 / per_call))
    samples = int(max(min_samples, target_s / (inner * per_call)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": samples * inner}


def time_call(
    fn: Callable[[], Any], device: torch.device, *, target_s: float, flusher: L2Flusher | None = None
) -> dict[str, Any]:
    """Dispatches to :func:`time_cuda` or :func:`time_cpu` by device."""
    if device.type == "cuda":
        return time_cuda(fn, target_s=target_s, flusher=flusher)
    return time_cpu(fn, target_s=target_s)


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 20) -> dict[str, float]:
    """Device-to-device copy bandwidth, the yardstick of the ``%copy`` column.

    Args:
        device: a CUDA device.
        nbytes: size of the source (and of the destination).
        reps: timed copies (after two untimed ones); the median is used.

    Returns:
        ``{"bytes", "median_ms", "gbps"}`` with ``gbps`` counting bytes read plus bytes written, in 1e9 B/s.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median_ms = statistics.median(times)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": moved, "median_ms": median_ms, "gbps": moved / (median_ms * 1e-3) / 1e9}


def peak_memory_above(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one call, above what was allocated before it (CUDA only).

    Args:
        fn: the call; its outputs are kept alive until the peak is read, so they count.
        device: the device.

    Returns:
        The bytes, or None on CPU.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


# ---------------------------------------------------------------------------------------------------------------
# peers that may be unavailable: torch.compile, CUDA graphs
# ---------------------------------------------------------------------------------------------------------------


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """One line describing an exception, for an "n/a" row."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def warm_up(fn: Callable[[], Any], device: torch.device, calls: int = 3) -> tuple[bool, str | None, float]:
    """Calls ``fn`` a few times (compilation happens here) and reports whether it worked.

    Args:
        fn: the call.
        device: its device (synchronized so that asynchronous errors surface here).
        calls: how many calls.

    Returns:
        ``(ok, reason_if_not, seconds_spent)``.
    """
    start = time.perf_counter()
    try:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # any failure of the optional peer makes its row "n/a", never a crash
        return False, short_reason(exc), time.perf_counter() - start
    return True, None, time.perf_counter() - start


def capture_cuda_graph(fn: Callable[[], Any]) -> tuple[Callable[[], None] | None, Any, str | None]:
    """Captures ``fn`` into a CUDA graph.

    Args:
        fn: the call, run on static inputs; it is warmed up on a side stream first, as capture requires.

    Returns:
        ``(replay, static_outputs, None)`` on success, ``(None, None, reason)`` on failure.
    """
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # e.g. a host sync inside the op: report it, keep the other rows
        try:
            torch.cuda.synchronize()
        except Exception:  # a failed capture can leave an error to surface here; the reason above is the one to show
            pass
        return None, None, short_reason(exc)
    return graph.replay, static_out, None


PEER_ORDER = ("eager", "compile", "liger", "grpo_ext", "grpo_ext+inplace", "grpo_ext+graph")


def add_optional_peers(
    case: str,
    steps: dict[str, Callable[[], Any] | None],
    make_compiled: Callable[[], Callable[[], Any]],
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[dict[str, str], Any, float | None]:
    """Adds the ``compile`` and (CUDA) ``grpo_ext+graph`` peers to ``steps``, as None with a note when unavailable.

    Args:
        case: the case's label, for messages.
        steps: name -> call; must hold ``"grpo_ext"``. Updated in place.
        make_compiled: builds the torch.compile step (compilation itself happens in the warm-up here).
        device: the device.
        args: the parsed command line (``no_compile``, ``no_graph``).

    Returns:
        ``(notes, graph_outputs, compile_s)``: why a peer is n/a, the graph's static outputs (None without a graph)
        and the seconds spent compiling (None when not compiled).
    """
    notes: dict[str, str] = {}
    compile_s = None
    if args.no_compile:
        steps["compile"], notes["compile"] = None, "skipped (--no-compile)"
    else:
        try:
            compiled = make_compiled()
            ok, reason, compile_s = warm_up(compiled, device)
        except Exception as exc:  # torch.compile itself may refuse (e.g. an unsupported Python)
            ok, reason = False, short_reason(exc)
        steps["compile"] = compiled if ok else None
        if not ok:
            notes["compile"] = f"torch.compile failed: {reason}"
            print(f"  [{case}] compile n/a: {reason}")

    graph_outputs = None
    if device.type == "cuda":
        if args.no_graph:
            steps["grpo_ext+graph"], notes["grpo_ext+graph"] = None, "skipped (--no-graph)"
        else:
            replay, graph_outputs, reason = capture_cuda_graph(steps["grpo_ext"])
            steps["grpo_ext+graph"] = replay
            if replay is None:
                notes["grpo_ext+graph"] = f"CUDA graph capture failed: {reason}"
                print(f"  [{case}] grpo_ext+graph n/a: {reason}")
    return notes, graph_outputs, compile_s


def time_peers(
    steps: dict[str, Callable[[], Any] | None],
    notes: dict[str, str],
    base_row: dict[str, Any],
    device: torch.device,
    *,
    target_s: float,
    flusher: L2Flusher | None,
    compile_s: float | None = None,
) -> list[dict[str, Any]]:
    """Times every available peer of one case (in :data:`PEER_ORDER`); an unavailable one gets an n/a row.

    Args:
        steps: name -> call, or None when unavailable.
        notes: name -> why it is unavailable.
        base_row: the case's fields (``case``, sizes, ``bytes``, ...), copied into every row.
        device: the device.
        target_s: timed seconds per peer.
        flusher: L2 eviction between CUDA repetitions, or None.
        compile_s: seconds the compile peer spent compiling, recorded in its row.

    Returns:
        One row per peer.
    """
    rows = []
    for name in PEER_ORDER:
        if name not in steps:
            continue
        row: dict[str, Any] = {**base_row, "impl": name, "median_ms": None, "note": notes.get(name)}
        step = steps[name]
        if step is not None:
            row.update(time_call(step, device, target_s=target_s, flusher=flusher))
            if name != "grpo_ext+graph":  # a graph's memory is its pool, allocated at capture
                row["peak_bytes"] = peak_memory_above(step, device)
        if name == "compile":
            row["compile_s"] = compile_s
        rows.append(row)
    return rows


def available(steps: dict[str, Any]) -> str:
    """``"eager, compile, grpo_ext"``: the peers that run, for the check line."""
    return ", ".join(name for name in PEER_ORDER if steps.get(name) is not None)


# ---------------------------------------------------------------------------------------------------------------
# agreement checks
# ---------------------------------------------------------------------------------------------------------------


def assert_matches(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    scale: float | None = None,
    ignore: torch.Tensor | None = None,
) -> float:
    """Asserts ``actual`` matches the float64 ``expected`` with ``dtype``'s tolerance; returns the max abs error.

    Args:
        name: what is compared (for the error message).
        actual: the peer's tensor (any dtype; compared in float64).
        expected: the float64 reference.
        dtype: the input dtype, which sets the tolerance (:data:`TOLERANCES`).
        scale: magnitude that the absolute tolerance is relative to; default ``max|expected|`` (at least 1e-6).
        ignore: bool mask of elements left out of the comparison (where the math is legitimately discontinuous).

    Returns:
        The largest absolute difference.

    Raises:
        AssertionError: on a mismatch (the benchmark must not time wrong results).
    """
    tol = TOLERANCES[dtype]
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    if ignore is not None:
        actual = torch.where(ignore, expected, actual)
    if scale is None:
        scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-6)
    torch.testing.assert_close(
        actual, expected, rtol=tol["rtol"], atol=tol["atol_rel"] * scale, msg=lambda m: f"{name}: {m}"
    )
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


# ---------------------------------------------------------------------------------------------------------------
# results: derived columns, table, JSON
# ---------------------------------------------------------------------------------------------------------------


def add_derived(rows: list[dict[str, Any]], copy_gbps: float | None) -> None:
    """Fills ``x_eager``/``x_compile`` (peer time / this row's time) and bandwidth columns, per case, in place.

    ``x_eager`` of the grpo_ext row is the speed-up of grpo_ext over eager; above 1 means faster.

    Args:
        rows: rows with ``case``, ``impl``, ``median_ms`` (None when n/a) and ``bytes``.
        copy_gbps: measured copy bandwidth (CUDA) or None.
    """
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["impl"]] = row
    for row in rows:
        peers = by_case[row["case"]]
        ms = row.get("median_ms")
        for peer, key in (("eager", "x_eager"), ("compile", "x_compile")):
            peer_ms = peers.get(peer, {}).get("median_ms")
            row[key] = peer_ms / ms if ms and peer_ms else None
        if copy_gbps is not None and ms:
            row["gbps"] = row["bytes"] / (ms * 1e-3) / 1e9
            row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps
        else:
            row["gbps"] = None
            row["pct_copy"] = None


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a" if spec == "ms" else "-"
    if spec == "ms":
        return f"{value:.4g}" if value < 1000 else f"{value:.0f}"
    if spec == "x":
        return f"{value:.2f}x"
    if spec == "f1":
        return f"{value:.1f}"
    if spec == "mib":
        return f"{value / 2**20:.1f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain aligned table: text left-aligned, numbers right-aligned; a blank line between cases.

    Args:
        rows: the rows.
        columns: ``(key, header, spec)`` with spec one of ``"s"`` (text), ``"ms"``, ``"x"``, ``"f1"``, ``"mib"``.

    Returns:
        The table as one string.
    """
    cells = [[_fmt(row.get(key), spec) for key, _, spec in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (_, header, _) in enumerate(columns)]

    def render(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if spec == "s" else v.rjust(w)
            for v, w, (_, _, spec) in zip(values, widths, columns, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [render([header for _, header, _ in columns]), render(["-" * w for w in widths])]
    previous_case = None
    for row, line in zip(rows, cells, strict=True):
        if previous_case is not None and row.get("case") != previous_case:
            lines.append("")
        previous_case = row.get("case")
        lines.append(render(line))
    return "\n".join(lines)


def report(
    script_file: str,
    title: str,
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    copy: dict[str, float] | None,
    args: argparse.Namespace,
    device: torch.device,
    flusher: L2Flusher | None,
) -> None:
    """Fills the derived columns, prints the table and the n/a reasons, and writes the JSON record.

    Args:
        script_file: the bench script's ``__file__`` (names the JSON file).
        title: the line printed above the table.
        rows: the rows of every case.
        env: :func:`environment`'s dict.
        copy: :func:`measure_copy_bandwidth`'s dict (CUDA) or None.
        args: the parsed command line, recorded as the run's settings.
        device: the device.
        flusher: the L2 flusher used, or None (recorded as the timer's kind).
    """
    add_derived(rows, copy["gbps"] if copy else None)
    columns = [
        ("case", "case", "s"),
        ("impl", "impl", "s"),
        ("median_ms", "ms", "ms"),
        ("x_eager", "x eager", "x"),
        ("x_compile", "x compile", "x"),
    ]
    if device.type == "cuda":
        columns += [("gbps", "GB/s", "f1"), ("pct_copy", "%copy", "f1"), ("peak_bytes", "peak MiB", "mib")]
    print()
    print(f"{title}, median time per call; 'x eager' = eager's time / this row's time (above 1: this row is faster)")
    print(format_table(rows, columns))
    for row in rows:
        if row.get("note"):
            print(f"n/a  {row['case']} {row['impl']}: {row['note']}")

    if device.type == "cuda":
        timer = "cuda_event_isolated_call" + ("_cold_l2" if flusher is not None else "_warm_l2")
    else:
        timer = "perf_counter_loop"
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    path = output_path(script_file, device, args.quick, args.out)
    write_json(
        path,
        {
            "benchmark": title,
            "environment": env,
            "settings": {**settings, "timer": timer},
            "copy_bandwidth": copy,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


def start(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any], dict[str, float] | None, L2Flusher | None]:
    """Resolves the device, prints its facts and measures the copy bandwidth (CUDA).

    Args:
        args: the parsed command line.

    Returns:
        ``(device, environment, copy_bandwidth_or_None, l2_flusher_or_None)``.
    """
    device = resolve_device(args.device)
    env = environment(device)
    print(f"device: {env['device_name']} | torch {env['torch_version']} | CUDA {env['cuda_version']}")
    copy, flusher = None, None
    if device.type == "cuda":
        copy = measure_copy_bandwidth(device)
        print(f"device-to-device copy: {copy['gbps']:.0f} GB/s (bytes read + written, 1 GiB source)")
        if not args.no_l2_flush:
            flusher = L2Flusher(device)
    return device, env, copy, flusher


def output_path(script_file: str, device: torch.device, quick: bool, override: Path | None) -> Path:
    """``benchmarks/out/<script>-<device>.json`` (``-quick`` added for smoke runs, so they never overwrite figures)."""
    if override is not None:
        return override
    suffix = "-quick" if quick else ""
    return OUT_DIR / f"{Path(script_file).stem}-{device.type}{suffix}.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
