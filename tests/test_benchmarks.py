"""The microbenchmarks run anywhere: each script's --quick mode, on the CPU, checks every peer against float64."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


SCRIPTS = [
    "bench_group_advantages.py",
    "bench_process_advantages.py",
    "bench_grpo_loss.py",
    "bench_selective_log_softmax.py",
    "bench_grpo_loss_from_logits.py",
    "bench_grpo_loss_from_hidden.py",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run_checks_and_writes_rows(script, tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(BENCHMARKS / script), "--quick", "--no-compile", "--device", "cpu", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "check " in result.stdout  # every peer was compared with the float64 reference before timing
    rows = json.loads(out.read_text())["rows"]
    timed = [row for row in rows if row["impl"] == "grpo_ext"]
    assert timed and all(row["median_ms"] > 0 for row in timed)


def test_every_script_is_listed():
    """One script per op, ``bench_<op>.py``: a new one must be added to SCRIPTS above to be smoke-run."""
    assert sorted(path.name for path in BENCHMARKS.glob("bench_*.py")) == sorted(SCRIPTS)
