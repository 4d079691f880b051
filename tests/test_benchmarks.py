"""The microbenchmarks run anywhere: each script's --quick mode, on the CPU, checks every peer against float64."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    "script", ["bench_group_advantages.py", "bench_grpo_loss.py", "bench_grpo_loss_from_logits.py"]
)
def test_quick_run_checks_and_writes_rows(script, tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(BENCHMARKS / script), "--quick", "--no-compile", "--device", "cpu", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "check " in result.stdout  # every peer was compared with the float64 reference before timing
    rows = json.loads(out.read_text())["rows"]
    timed = [row for row in rows if row["impl"] == "grpo_ext"]
    assert timed and all(row["median_ms"] > 0 for row in timed)
