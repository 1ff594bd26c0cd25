#!/usr/bin/env python3
"""How long bad input to the command line takes to be refused, each run a fresh process.

    .venv/bin/python benchmarks/cli_errors.py [--runs 5] [--src DIR]

Runs each bad command ``--runs`` times as ``python -m tierflow ...`` (with ``--src``, the
tierflow of another checkout's ``src``, e.g. an older commit's worktree, for comparison),
checks that it exits with 2 and one ``tierflow: error:`` line, and prints the median wall
time per command. Flags, paths, a model directory's config.json and weight files and
``--resume``'s directory are checked before torch is imported, so these should take about
what starting Python and importing tierflow's command line take.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scratch_inputs(scratch: Path) -> tuple[Path, Path, Path]:
    """(a token directory of vocab 64, a model directory holding only a config.json, one
    whose config.json states 32 positions beside a weights file) under ``scratch``."""
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np

    from tierflow.data.tokenfile import write_tokens
    data, no_weights, short = scratch / "data", scratch / "no-weights", scratch / "short"
    for directory in (data, no_weights, short):
        directory.mkdir()
    write_tokens(data / "train.bin", np.arange(4096) % 64, 64)
    config = json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                         "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 4, "max_position_embeddings": 32})
    (no_weights / "config.json").write_text(config)
    (short / "config.json").write_text(config)
    (short / "model.safetensors").write_bytes(b"")  # refused first for --seq-len
    return data, no_weights, short


def commands(scratch: Path) -> dict[str, list[str]]:
    """Name -> arguments of ``tierflow``; each must be refused."""
    data, no_weights, short = scratch_inputs(scratch)
    return {
        "--version (not refused: the parser alone)": ["--version"],
        "train, --data missing": ["train", "--model", "llama-20m", "--data",
                                  str(scratch / "nope")],
        "train, --lr -1": ["train", "--model", "llama-20m", "--data", str(scratch), "--lr=-1"],
        "train, --steps many": ["train", "--model", "llama-20m", "--steps", "many"],
        "generate, --model missing": ["generate", "--model", str(scratch / "nope"), "--prompt",
                                      "x"],
        "train, --model without weights": ["train", "--model", str(no_weights), "--data",
                                           str(data), "--out", str(scratch / "out")],
        "train, --seq-len 64 over 32 positions": ["train", "--model", str(short), "--data",
                                                  str(data), "--seq-len", "64", "--out",
                                                  str(scratch / "out")],
        "train, --resume missing": ["train", "--model", str(short), "--data", str(data),
                                    "--resume", str(scratch / "nope")],
    }


def timed(args: list[str], src: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, env=env)
    seconds = time.perf_counter() - start
    if args != ["--version"]:
        lines = proc.stderr.strip().splitlines()
        if proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith("tierflow: error"):
            raise SystemExit(f"{args}: expected one error line and exit code 2, got "
                             f"{proc.returncode}: {proc.stderr[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--src", type=Path, default=ROOT / "src")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        print(f"tierflow from {args.src}; median of {args.runs} fresh processes")
        for name, argv in commands(Path(scratch)).items():
            runs = [timed(argv, args.src) for _ in range(args.runs)]
            print(f"  {name:45s} {statistics.median(runs):6.2f} s")


if __name__ == "__main__":
    main()
