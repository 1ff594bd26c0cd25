#!/usr/bin/env python3
"""How long `tierflow plan` takes, this tree against an earlier commit, in the same run.

    ./run python benchmarks/plan_speed.py --base REF [--rounds 2] [--tag TAG]

Each configuration runs `python -m tierflow plan ... --json` in a fresh process from each
source tree (REF's checked out into a temporary git worktree), the trees alternating, and
compares the printed plans: a faster planner must print the same plan (or the same refusal).
The configurations: Llama-3-8B at seq 4096 on an H100 under 24 GiB of GPU and 256 GiB of
host RAM (a plan), and under 8 and 32 GiB (refused after trying every precision that could
fit: the slowest path a user meets), and Llama-3.2-1B under 8 and 32 GiB.
Writes benchmarks/results/plan-speed-<date>[-TAG].json: per configuration and tree the
median wall seconds over the rounds, each round's, the exit code, and the ratio of this
tree to the base; the CPU is named. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierflow.profile.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = {
    "llama3-8b gpu 24 ram 256": ["--model", "llama3-8b", "--gpu", "24", "--ram", "256"],
    "llama3-8b gpu 8 ram 32 (refused)": ["--model", "llama3-8b", "--gpu", "8", "--ram", "32"],
    "llama3.2-1b gpu 8 ram 32": ["--model", "llama3.2-1b", "--gpu", "8", "--ram", "32"],
}
COMMON = ["--hardware", "h100-sxm", "--seq-len", "4096", "--json"]


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                          text=True, check=True).stdout.strip()


def timed_plan(tree: Path, args: list[str]) -> dict:
    """One `tierflow plan` in a fresh process from ``tree``'s source: seconds, exit code, and
    what it printed (the plan's JSON, or the refusal's line)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tierflow", "plan", *args, *COMMON],
                          capture_output=True, text=True, env=env, cwd=tree)
    seconds = time.perf_counter() - started
    printed = proc.stdout if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]
    return {"seconds": round(seconds, 2), "code": proc.returncode, "printed": printed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git ref to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            trees = {"base": base, "head": ROOT}
            for name, config in CONFIGS.items():
                runs: dict[str, list[dict]] = {"base": [], "head": []}
                for _ in range(args.rounds):
                    for tree in runs:  # alternating, each in a fresh process
                        runs[tree].append(timed_plan(trees[tree], config))
                        print(f"{name} {tree}: {runs[tree][-1]['seconds']} s", flush=True)
                row = {"config": name, "args": config + COMMON,
                       "same_output": len({r["printed"] for t in runs.values() for r in t}) == 1}
                for tree, rounds in runs.items():
                    row[tree] = {"median_s": statistics.median(r["seconds"] for r in rounds),
                                 "rounds_s": [r["seconds"] for r in rounds],
                                 "codes": [r["code"] for r in rounds]}
                row["ratio"] = round(row["head"]["median_s"] / row["base"]["median_s"], 3)
                rows.append(row)
            result = {"date": stamp, "cpu": cpu_model(), "cores": os.cpu_count(),
                      "base": commit_of(base), "head": commit_of(ROOT),
                      "rounds": args.rounds, "rows": rows}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)
    out = RESULTS / f"plan-speed-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"{row['config']:<36} base {row['base']['median_s']:7.1f} s  this tree "
              f"{row['head']['median_s']:6.1f} s  {row['ratio']:.2f}x  same output: "
              f"{row['same_output']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
