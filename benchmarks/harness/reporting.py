"""The results of a run: derived columns (speed-ups, bandwidth), the printed table and the JSON record."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import checks

if TYPE_CHECKING:
    from .timing import L2Flusher

OUT_DIR = Path(__file__).resolve().parent.parent / "out"


def add_derived(rows: list[dict[str, Any]], copy_gbps: float | None) -> None:
    """Fills ``x_eager``/``x_compile`` (peer time / this row's time) and bandwidth columns, per case, in place.

    ``x_eager`` of the grpo_ext row is the speed-up of grpo_ext over eager; above 1 means faster.

    Args:
        rows: rows with ``case``, ``impl``, ``median_ms`` (None when n/a) and ``bytes`` (0 or absent: not counted,
            the bandwidth columns then print ``-``).
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
        if copy_gbps is not None and ms and row.get("bytes"):  # no bytes counted (an overhead row): no bandwidth
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
    bytes_note: str | None = None,
) -> None:
    """Fills the derived columns, prints the table and the n/a reasons, and writes the JSON record.

    Args:
        script_file: the bench script's ``__file__`` (names the JSON file).
        title: the line printed above the table.
        rows: the rows of every case.
        env: :func:`harness.environment.environment`'s dict.
        copy: :func:`harness.timing.measure_copy_bandwidth`'s dict (CUDA) or None.
        args: the parsed command line, recorded as the run's settings.
        device: the device.
        flusher: the L2 flusher used, or None (recorded as the timer's kind).
        bytes_note: what a row's ``bytes`` count (printed under the table on CUDA, recorded in the JSON), or None.
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
    if bytes_note and device.type == "cuda":
        print(f"GB/s and %copy: bytes that must move ({bytes_note}) / time")
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
            "bytes_counted": bytes_note,
            "copy_bandwidth": copy,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


def output_path(script_file: str, device: torch.device, quick: bool, override: Path | None) -> Path:
    """``benchmarks/out/<script>-<device>.json`` (``-quick`` added for smoke runs, so they never overwrite figures)."""
    if override is not None:
        return override
    suffix = "-quick" if quick else ""
    return OUT_DIR / f"{Path(script_file).stem}-{device.type}{suffix}.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` as indented JSON, creating the folder; then fails the run (status 1) where grpo_ext's own op
    disagreed with the reference (:func:`harness.checks.fail_if_grpo_ext_disagreed`), its record kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    checks.fail_if_grpo_ext_disagreed()
