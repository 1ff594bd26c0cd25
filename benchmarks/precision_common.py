"""What the three precision benchmarks share: the precision configurations by name, running
``tierflow train`` in a fresh process and reading its log, and writing the results files.

Used by ``precision_quality.py``, ``precision_memory.py`` and ``precision_speed.py``; not a
benchmark itself.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# name -> the tierflow train flags that select it (everything else is the same in a comparison)
CONFIGS: dict[str, tuple[str, ...]] = {
    "fp32": ("--dtype", "fp32"),
    "bf16-autocast": ("--matmul-dtype", "bf16"),
    "bf16-weights-fp32-master": ("--model-dtype", "bf16", "--master", "fp32"),
    "bf16-sr-bf16-moments": ("--model-dtype", "bf16", "--master", "none", "--optim-dtype", "bf16"),
    "bf16-moments": ("--matmul-dtype", "bf16", "--optim-dtype", "bf16"),
    "int8-moments": ("--matmul-dtype", "bf16", "--optim-dtype", "int8"),
    "bf16-sr-int8-moments": ("--model-dtype", "bf16", "--master", "none", "--optim-dtype", "int8"),
    "fp8": ("--matmul-dtype", "fp8"),
}


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine() -> dict[str, Any]:
    """The machine the figures belong to."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "avx512_bf16": " avx512_bf16" in flags, "amx_bf16": " amx_bf16" in flags}


def run_train(name: str, args: list[str], work: Path, *, threads: int | None = None,
              timeout: float | None = None) -> dict[str, Any]:
    """``tierflow train ARGS`` + CONFIGS[name] in a fresh process (via /bin/sh, so that the
    child's RSS baseline is its own); returns its log's records by kind and the wall time."""
    out = work / name
    log = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "tierflow", "train", *args, *CONFIGS[name], "--out", str(out),
           "--log", str(log)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = dt.datetime.now()
    load_before = load_average()
    proc = subprocess.run(["/bin/sh", "-c", '"$@"', "sh", *cmd], env=env, capture_output=True,
                          text=True, timeout=timeout)
    wall = (dt.datetime.now() - started).total_seconds()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: tierflow train failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    records: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    print(f"  {name}: {wall:.0f} s (load {load_before[0]:.2f} before)", flush=True)
    return {"name": name, "flags": list(CONFIGS[name]), "wall_s": round(wall, 1),
            "load_before": [round(x, 2) for x in load_before], "records": records}


def write_results(stem: str, table: str, data: dict[str, Any]) -> tuple[Path, Path]:
    """benchmarks/results/<stem>-<date>.md and .json."""
    return harness.write_results(RESULTS, f"{stem}-{dt.date.today().isoformat()}", table, data)
