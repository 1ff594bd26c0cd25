"""What the benchmark scripts share: the commit a benchmark measured and where its results go.

A script runs each configuration in a fresh process with ``tierflow.cli.measure.run_json`` (the
runner ``tierflow compare`` uses), then writes ``results/<name>.md`` (the table) and
``results/<name>.json`` (every record) with ``write_results``, naming the measured source
with ``source_commit`` and the machine with ``machine``. Scripts import it as ``from harness
import ...`` (Python puts the script's directory first on the path).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def source_commit(root: str | Path) -> str:
    """The commit checked out in ``root`` that a benchmark measured, with ``+changes`` when
    its ``src`` differs from it ("unknown" outside a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "src") else "")


def write_results(directory: str | Path, name: str, text: str,
                  data: dict[str, Any]) -> tuple[Path, Path]:
    """A benchmark's results: ``directory/name.md`` (``text``) and ``directory/name.json``
    (``data``); returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    md, js = directory / f"{name}.md", directory / f"{name}.json"
    md.write_text(text.rstrip() + "\n")
    js.write_text(json.dumps(data, indent=1) + "\n")
    return md, js


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on: CPU model (family and model numbers: "AMD EPYC" names
    several), the flags that matter, cores, memory, the torch measured."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    cpu = f"{info.get('model name', 'unknown')} (family {info.get('cpu family', '?')}, " \
          f"model {info.get('model', '?')})"
    flags = set(info.get("flags", "").split())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text()
               .splitlines() if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "python": platform.python_version(), "kernel": platform.release(),
            "torch": importlib.metadata.version("torch")}


def predicted_ram_peak(plan: dict) -> int:
    """What a `tierflow train` log's plan record predicts for its step records' ``ram_bytes``
    (the RSS peak above the post-import baseline) on a CPU: the plan's peak plus what the
    process held outside the plan when it planned (torch's first-use caches, the model's
    objects: the plan was made for ``--ram`` less that)."""
    return plan["predicted_peak"] + plan.get("held_outside_the_plan", 0)
