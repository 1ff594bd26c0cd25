#!/usr/bin/env python3
"""Whether `tierflow plan` prints the plan `tierflow train` runs, for W2 on this machine.

    ./run python benchmarks/same_plan.py [--budgets 2GiB,4GiB,8GiB] [--rounds 2] [--dtype fp32]
        [--tag TAG]

W2: tinyllama-1.1b, seq 1024, batch 2, bf16 (``--dtype``) matmuls, AdamW without clipping,
its model built onto a disk tier, under each `--ram` budget. Per budget, in fresh processes
one after another: `tierflow train --steps 1` ``--rounds`` times (the trainer's own plan from
one process to the next), then `tierflow plan --hardware cpu --measure` (on what the last
trainer measured and kept, profile/kept_profiles.py) and `tierflow plan --hardware cpu`
(analytic costs). The processes share a tierflow cache of their own, empty at the start:
the first one measures the stages', the optimizer's and the disk's timings and keeps them
(profile/machine.py), and every later one plans from them. Recorded per run: the plan's decisions
(`Plan.decisions`), its predicted step and peak; per budget: which runs made the same
decisions as which. Writes benchmarks/results/same-plan-<date>[-TAG].json after each budget.
Run it on a quiet machine: the plans follow the measured times.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import tempfile
from pathlib import Path

from against_base import GIB, PLAN_COMMANDS, VOCAB, predicted_decisions, train_records
from harness import predicted_ram_peak
from random_tokens import random_token_files
from tierflow.profile.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL, BATCH = "tinyllama-1.1b", 2


def trainer_plan(ram: str, data: Path, work: Path, dtype: str) -> dict:
    """The plan one `tierflow train --steps 1` process ran: decisions and predictions."""
    records = train_records(ROOT, MODEL, BATCH, ram, 1, data, work, dtype)
    if "error" in records:
        return records
    plan = records["plan"][0]
    return {"decisions": plan["decisions"],
            "predicted_step_s": round(plan["predicted_step_s"], 3),
            "predicted_peak_gib": round(predicted_ram_peak(plan) / GIB, 3)}


def agreement(runs: dict[str, dict]) -> dict[str, bool]:
    """For each pair of runs with decisions, whether they are the same."""
    named = [(name, run["decisions"]) for name, run in runs.items() if "decisions" in run]
    return {f"{a} = {b}": da == db for i, (a, da) in enumerate(named)
            for b, db in named[i + 1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="2GiB,4GiB,8GiB", help="--ram values, commas")
    parser.add_argument("--rounds", type=int, default=2, help="trainer processes per budget")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="the matmuls' dtype (fp32 on a CPU without native bf16)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    result = {"date": stamp, "cpu": cpu_model(), "cores": os.cpu_count(), "commit": commit,
              "workload": f"W2: {MODEL}, seq 1024, batch {BATCH}, {args.dtype} matmuls, no "
                          "clipping",
              "rows": []}
    out = RESULTS / f"same-plan-{stamp}.json"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # a cache of its own: the first process measures the timings the others then keep
        os.environ["TIERFLOW_CACHE"] = str(tmp / "cache")
        data = random_token_files(tmp / "data", VOCAB)
        for ram in args.budgets.split(","):
            runs = {f"train {k + 1}": trainer_plan(ram, data, tmp / f"{ram}-{k}", args.dtype)
                    for k in range(args.rounds)}
            for flags, _same in PLAN_COMMANDS.values():
                name = "plan --measure" if flags else "plan"
                runs[name] = predicted_decisions(ROOT, MODEL, BATCH, ram, tmp / "disk", flags,
                                                 args.dtype)
            result["rows"].append({"ram": ram, "runs": runs, "same": agreement(runs)})
            print(ram, json.dumps(result["rows"][-1]["same"]), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
