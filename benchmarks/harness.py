"""What the benchmark scripts share: the commit a benchmark measured and where its results go.

A script runs each configuration in a fresh process with ``tierflow.measure.run_json`` (the
runner ``tierflow compare`` uses), then writes ``results/<name>.md`` (the table) and
``results/<name>.json`` (every record) with ``write_results``, naming the measured source
with ``source_commit``. Scripts import it as ``from harness import ...`` (Python puts the
script's directory first on the path).
"""
from __future__ import annotations

import json
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
