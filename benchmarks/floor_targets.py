"""Issue 38 item 2's targets for the fused logits pass, judged from ``bench_floor.py``'s rows.

The issue sets them for an H100 (forward + backward, ``do_bench`` medians, time over a copy of the logits); the
verdicts are printed for whatever device ran the table, so that a GPU session reads them off instead of working
them out, and a session on another card sees how far it is. Per logits shape:

* about half the rows kept (bench_floor's prefix masks): the fastest grpo_ext layout at most 0.85x the copy at
  8192 x 151936 and 32768 x 151936 bf16, at most 0.90x at 16384 x 32000 and 2048 x 262144 bf16, and on those
  four at least 1.2x faster than Liger's ``triton_grpo_loss``; on every shape, the entropy bonus within 2% of the
  same layout without it;
* every row kept, bf16 and float32: the fastest layout at most 1.05x the copy (the single-read pass's bytes are a
  copy's);
* every row masked: no layout reads a masked row, so each writes the zero gradient and reads nothing of the logits:
  half a copy's bytes, plus the call's fixed cost (about 0.08 ms on an H200: 0.66x at the smallest shapes). At most
  0.75x the copy says so on a GPU, where a pass that read the rows would take a copy or more.

The fastest layout is named beside the default (``grpo_ext``): the chooser takes the single-read pass where it wins.
"""

from __future__ import annotations

from typing import Any

# bench_floor.py's case names: "logits N=.. V=.. dtype", and the same with a suffix for the masks below
ALL_KEPT = "every row kept"
ALL_MASKED = "every row masked"
HALF_KEPT_MAX_X_COPY = {
    "logits N=8192 V=151936 bfloat16": 0.85,
    "logits N=32768 V=151936 bfloat16": 0.85,
    "logits N=16384 V=32000 bfloat16": 0.90,
    "logits N=2048 V=262144 bfloat16": 0.90,
}
ALL_KEPT_MAX_X_COPY = 1.05
MIN_SPEEDUP_OVER_LIGER = 1.2
MAX_ENTROPY_COST = 1.02
MAX_MASKED_X_COPY = 0.75
ENTROPY = "+entropy"  # bench_floor's suffix of a layout's row with the entropy bonus


def _layouts(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The grpo_ext layouts that ran (name -> ms), the entropy-bonus rows left out."""
    return {
        impl: row["median_ms"]
        for impl, row in rows.items()
        if impl.startswith("grpo_ext") and not impl.endswith(ENTROPY) and row.get("median_ms")
    }


def _verdict(case: str, target: str, value: float | None, limit: float, at_most: bool, detail: str,
             missing: str) -> dict[str, Any]:  # fmt: skip
    bound = f"{'<=' if at_most else '>='} {limit:.2f}x"
    if value is None:
        return {"case": case, "target": target, "value": None, "limit": bound, "verdict": "n/a", "detail": missing}
    met = value <= limit if at_most else value >= limit
    return {"case": case, "target": target, "value": value, "limit": bound, "verdict": "met" if met else "missed",
            "detail": detail}  # fmt: skip


def _half_kept(case: str, rows: dict[str, dict[str, Any]], copy: float | None) -> list[dict[str, Any]]:
    out = []
    layouts = _layouts(rows)
    best = min(layouts, key=layouts.get) if layouts else None
    best_ms = layouts.get(best) if best else None
    default = rows.get("grpo_ext", {}).get("median_ms")
    detail = f"fastest {best}" + (f"; default grpo_ext {default / copy:.2f}x" if default and copy else "")
    if case in HALF_KEPT_MAX_X_COPY:
        value = best_ms / copy if best_ms and copy else None
        out.append(_verdict(case, "fastest layout / copy", value, HALF_KEPT_MAX_X_COPY[case], True, detail,
                            "no grpo_ext layout or copy timed"))  # fmt: skip
        liger = rows.get("liger", {})
        speedup = liger["median_ms"] / best_ms if liger.get("median_ms") and best_ms else None
        out.append(_verdict(case, "Liger / fastest layout", speedup, MIN_SPEEDUP_OVER_LIGER, False,
                            f"Liger {liger.get('median_ms') or 0:.4g} ms, {best} {best_ms or 0:.4g} ms",
                            liger.get("note") or "Liger not timed"))  # fmt: skip
    for layout, ms in layouts.items():
        with_bonus = rows.get(layout + ENTROPY, {}).get("median_ms")
        if with_bonus:
            out.append(_verdict(case, f"{layout}{ENTROPY} / {layout}", with_bonus / ms, MAX_ENTROPY_COST, True,
                                f"{with_bonus:.4g} against {ms:.4g} ms", ""))  # fmt: skip
    return out


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 38 item 2's verdicts from bench_floor's logits rows.

    Args:
        rows: bench_floor's rows (``case``, ``impl``, ``median_ms`` or None, ``note``); other cases are ignored.

    Returns:
        One row per target and shape: ``case``, ``target``, ``value`` (a ratio, None when not measured),
        ``limit``, ``verdict`` (``met``, ``missed`` or ``n/a``) and ``detail``.
    """
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["case"].startswith("logits "):
            by_case.setdefault(row["case"], {})[row["impl"]] = row
    verdicts = []
    for case, case_rows in by_case.items():
        copy = case_rows.get("copy", {}).get("median_ms")
        layouts = _layouts(case_rows)
        if case.endswith(ALL_KEPT):
            best = min(layouts, key=layouts.get) if layouts else None
            value = layouts[best] / copy if best and copy else None
            verdicts.append(_verdict(case, "fastest layout / copy", value, ALL_KEPT_MAX_X_COPY, True,
                                     f"fastest {best}", "no grpo_ext layout or copy timed"))  # fmt: skip
        elif case.endswith(ALL_MASKED):
            worst = max(layouts, key=layouts.get) if layouts else None
            value = layouts[worst] / copy if worst and copy else None
            verdicts.append(_verdict(case, "slowest layout / copy", value, MAX_MASKED_X_COPY, True,
                                     f"slowest {worst}", "no grpo_ext layout or copy timed"))  # fmt: skip
        else:
            verdicts += _half_kept(case, case_rows, copy)
    return verdicts


def format_verdicts(verdicts: list[dict[str, Any]]) -> str:
    """The verdicts as an aligned table (harness.reporting's)."""
    from harness import reporting

    cols = [("case", "case", "s"), ("target", "target", "s"), ("value", "value", "x"), ("limit", "limit", "s"),
            ("verdict", "verdict", "s"), ("detail", "detail", "s")]  # fmt: skip
    return reporting.format_table(verdicts, cols)
