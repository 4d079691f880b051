"""bench_trl_real.py's report: the table of the three runs (one row per measure, one column per trainer), its checks,
and its section of benchmarks/RESULTS.md."""

from __future__ import annotations

import re
import statistics
import textwrap
from pathlib import Path
from typing import Any

REWARD_BIN = 10  # the table's mean train reward over steps 1-10, 11-20, ...
SECTION_PREFIX = "### A real model beside TRL (issue 24)"
SECTION_TITLE = SECTION_PREFIX + ": SmolLM2-135M-Instruct, two-digit sums, 2 CPU cores ({date})"


def eval_steps_of(steps: int, eval_steps: int) -> list[int]:
    """The steps after which the held-out accuracy is measured: 0, every ``eval_steps``, and the last."""
    marks = [0] + ([s for s in range(eval_steps, steps + 1, eval_steps)] if eval_steps > 0 else [])
    return marks if marks[-1] == steps else [*marks, steps]


def reward_bins(steps: int) -> list[tuple[int, int]]:
    """``[(1, 10), (11, 20), ...]`` up to ``steps``."""
    return [(a, min(a + REWARD_BIN - 1, steps)) for a in range(1, steps + 1, REWARD_BIN)]


def summarize(result: dict[str, Any], steps: int, eval_steps: int) -> dict[str, str]:
    """The table's cells of one run, by row label."""
    if "error" in result:
        return {"error": result["error"]}
    cells: dict[str, str] = {}
    accuracy = {e["step"]: e["accuracy"] for e in result["evals"]}
    for step in eval_steps_of(steps, eval_steps):
        value = accuracy.get(step)
        cells[f"held-out accuracy, step {step}"] = "-" if value is None else f"{value:.1%}"
    rows = result["rows"]
    for a, b in reward_bins(steps):
        values = [r["reward"] for r in rows if a <= r["step"] <= b and r["reward"] is not None]
        cells[f"train reward, steps {a}-{b}"] = f"{statistics.fmean(values):.3f}" if values else "-"
    for key, label in (("step_s", "median step (s)"), ("generation_s", "median generation (s)"),
                       ("rest_s", "median rest (s)")):  # fmt: skip
        cells[label] = f"{statistics.median(r[key] for r in rows):.1f}" if rows else "-"
    cells["peak RSS (MiB)"] = f"{result['peak_rss_mib']:.0f}"
    cells["peak RSS after loading (MiB)"] = f"{result['peak_rss_after_load_mib']:.0f}"
    cells["load average, start / end"] = "{:.1f} / {:.1f}".format(*result["load_average"])
    return cells


def table_rows(results: list[dict[str, Any]], steps: int, eval_steps: int) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: one row per measure, one column per run."""
    cells = [summarize(r, steps, eval_steps) for r in results]
    labels = list(dict.fromkeys(label for c in cells for label in c))
    header = ["", *[r["run"] for r in results]]
    return header, [[label, *[c.get(label, "-") for c in cells]] for label in labels]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def checks(results: list[dict[str, Any]]) -> tuple[bool, list[str]]:
    """Whether the step-0 held-out accuracies agree (the untrained model, greedy: they must), and the findings
    (that check, and whether the runs trained on the same prompts at every step)."""
    done = [r for r in results if "error" not in r]
    notes: list[str] = []
    before = {r["run"]: next((e["accuracy"] for e in r["evals"] if e["step"] == 0), None) for r in done}
    agree = len(set(before.values())) <= 1 and None not in before.values()
    listed = ", ".join(f"{k} {'-' if v is None else f'{v:.1%}'}" for k, v in before.items())
    notes.append(f"step-0 held-out accuracy: {listed} ({'identical' if agree else 'MISMATCH'})")
    if len(done) > 1:
        prompts = [[row["prompts"] for row in r["rows"]] for r in done]
        shortest = min(len(p) for p in prompts)
        differing = [step + 1 for step in range(shortest) if any(p[step] != prompts[0][step] for p in prompts)]
        notes.append("prompts drawn: the same 4 sums at every step in every run" if not differing else
                     f"prompts drawn: the runs differ at steps {differing[:10]}")  # fmt: skip
    return agree, notes


def results_md_section(header: list[str], rows: list[list[str]], notes: list[str], payload: dict[str, Any],
                       date: str) -> str:  # fmt: skip
    """The markdown section of RESULTS.md for this run."""
    env, done = payload["environment"], [r for r in payload["results"] if "error" not in r]
    versions = done[0]["versions"] if done else {}
    paragraphs = [
        f"Command: `{payload['command']}` (raw per-step rows: `{payload['json']}`). "
        f"Machine: {env['cpu']}, {payload['settings']['threads']} cores (`torch.set_num_threads"
        f"({payload['settings']['threads']})`), shared with other work (load averages in the table); Python "
        f"{env['python_version']}, torch {versions.get('torch')}, transformers {versions.get('transformers')}, trl "
        f"{versions.get('trl')}, grpo_ext {versions.get('grpo_ext')} (commit {payload['commit']}).",
        "`examples/smollm2_sums.py`'s model, data and reward and `examples/smollm2_sums.yaml`'s run: SmolLM2-135M-"
        "Instruct (Q4_1 GGUF dequantized to float32), 4 prompts x 8 completions of at most 16 tokens per step, "
        "temperature 1, `dapo`, beta 0, epsilon 0.2, AdamW at a constant 1e-5, clipping at 1.0, seed "
        f"{payload['settings']['seed']}, one process per trainer, one after another. `trl`: TRL's own `GRPOTrainer`; "
        "`trl+grpo_ext`: `GRPOExtTrainer` (fused loss); `grpo_ext`: grpo_ext's trainer (`logps_backend=\"fused\"`). "
        "Held-out accuracy: greedy answers to the 64 held-out sums, generated the same way for the three (grpo_ext's "
        "`eval_dataset`; a callback for TRL). Step times: wall time of the optimizer step (generation, scoring, "
        "loss, backward, AdamW), held-out evaluation excluded; generation: time inside the policy's `generate`. "
        "Peak RSS: `ru_maxrss` of the trainer's process at the end and just after the model was loaded. The three "
        "runs train on the same prompts at every step; `trl` and `trl+grpo_ext` sample from the same global torch "
        "RNG stream (the same completions while their float32 updates agree closely enough), `grpo_ext` from "
        "per-row seeded streams (other completions from the first step on): its accuracies are another run of the "
        "same recipe (`benchmarks/bench_trl_real.py`'s docstring lists every setting and what differs).",
    ]  # fmt: skip
    # Prose wrapped at 120 columns like the rest of the file; the table and the notes as they are.
    wrapped = [textwrap.fill(p, 120, break_long_words=False, break_on_hyphens=False) for p in paragraphs]
    notes_md = [f"- {note}" for note in notes]
    return "\n\n".join([SECTION_TITLE.format(date=date), *wrapped, markdown_table(header, rows), "\n".join(notes_md)])


def write_results_md(path: Path, section: str) -> None:
    """Replaces the section titled ``SECTION_PREFIX...`` in ``path``, or inserts it before ``## GPU`` (else at the
    end); the other sections are left as they are."""
    lines = path.read_text().splitlines()
    heading = re.compile(r"^#{1,3} ")
    begin = next((i for i, line in enumerate(lines) if line.startswith(SECTION_PREFIX)), None)
    if begin is not None:
        end = next((i for i in range(begin + 1, len(lines)) if heading.match(lines[i])), len(lines))
    else:
        begin = end = next((i for i, line in enumerate(lines) if line.strip() == "## GPU"), len(lines))
    new = [*section.rstrip("\n").splitlines(), ""]
    path.write_text("\n".join([*lines[:begin], *new, *lines[end:]]) + "\n")
