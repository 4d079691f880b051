"""The peers of a case: the optional ones (torch.compile, CUDA-graph replay), their warm-up, and their timing."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .timing import L2Flusher, peak_memory_above, time_call


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


#: The order of a case's rows; a peer not named here follows them, in the order the script built it.
PEER_ORDER = ("eager", "compile", "liger", "grpo_ext", "grpo_ext+group_ids", "grpo_ext+inplace",
              "grpo_ext/single-read", "grpo_ext+graph")  # fmt: skip


def ordered(names: Any) -> list[str]:
    """``names`` in :data:`PEER_ORDER`, those it does not name after them in their own order: every name kept."""
    names = list(dict.fromkeys(names))
    return [name for name in PEER_ORDER if name in names] + [name for name in names if name not in PEER_ORDER]


def add_compile_peer(
    case: str,
    steps: dict[str, Callable[[], Any] | None],
    make_compiled: Callable[[], Callable[[], Any]],
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[dict[str, str], float | None]:
    """Adds the ``compile`` peer to ``steps``, as None with a note when skipped or when compiling fails.

    Args:
        case: the case's label, for messages.
        steps: name -> call. Updated in place.
        make_compiled: builds the torch.compile step (compilation itself happens in the warm-up here).
        device: the device.
        args: the parsed command line (``no_compile``).

    Returns:
        ``(notes, compile_s)``: why the peer is n/a (empty when it runs) and the seconds spent compiling (None when
        not compiled).
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
    return notes, compile_s


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
        make_compiled: builds the torch.compile step (see :func:`add_compile_peer`).
        device: the device.
        args: the parsed command line (``no_compile``, ``no_graph``).

    Returns:
        ``(notes, graph_outputs, compile_s)``: why a peer is n/a, the graph's static outputs (None without a graph)
        and the seconds spent compiling (None when not compiled).
    """
    notes, compile_s = add_compile_peer(case, steps, make_compiled, device, args)
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
    """Times every available peer of one case (in :func:`ordered`'s order); an unavailable one gets an n/a row.

    Every key of ``steps`` gets a row, so that a peer built on one device only (a CUDA layout) cannot drop out of
    the table unnoticed.

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
    for name in ordered(steps):
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


def outputs_of(
    steps: dict[str, Callable[[], Any] | None], graph_outputs: Any, keep: Callable[[Any], Any] | None = None
) -> dict[str, Any]:
    """Every available peer's outputs of one call, for the agreement check before timing.

    Args:
        steps: name -> call, or None when unavailable.
        graph_outputs: the CUDA graph's static outputs (written by the replay that followed the capture), or None.
        keep: applied to each peer's outputs as soon as they are made (e.g. the first rows), or None for all.

    Returns:
        name -> outputs.
    """
    keep = keep or (lambda out: out)
    outputs = {name: keep(step()) for name, step in steps.items() if step is not None and name != "grpo_ext+graph"}
    if graph_outputs is not None:
        outputs["grpo_ext+graph"] = keep(graph_outputs)
    return outputs


def available(steps: dict[str, Any]) -> str:
    """``"eager, compile, grpo_ext"``: the peers that run, for the check line."""
    return ", ".join(name for name in ordered(steps) if steps[name] is not None)


def with_env(variables: dict[str, str], fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with the environment variables set (the CUDA launcher reads them at each call)."""

    def step():
        before = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            return fn()
        finally:
            for name, value in before.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    return step
