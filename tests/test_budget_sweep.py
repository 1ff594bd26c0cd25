"""The budget sweep's short form (benchmarks/budget_sweep.py --short): a tiny Llama at the
smallest budget tierflow names, each run a fresh process, held by a memory cgroup where one
can be made; its peak RSS above the baseline is at most the budget, and the JSON it writes
names the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tierflow.exec import enforce

ROOT = Path(__file__).resolve().parents[1]


def test_the_short_sweep_keeps_its_budget(tmp_path):
    held = [r for r in (enforce.v2_parent(os.getpid()), enforce.v1_parent(os.getpid()))
            if not isinstance(r, str)]
    argv = [sys.executable, str(ROOT / "benchmarks" / "budget_sweep.py"), "--short", "--out",
            str(tmp_path)] + (["--enforce"] if held else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = tmp_path.glob("budget-sweep-*-short*.json")
    data = json.loads(result.read_text())
    assert data["machine"]["cpu"] and data["machine"]["cores"] >= 1
    (run,) = data["records"]
    assert run["status"] == "ok", run  # not refused twice, not killed by the kernel
    assert run["peak_above_baseline_bytes"] <= run["budget"], run
