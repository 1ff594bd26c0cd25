#!/usr/bin/env python3
"""The smallest budget `tierflow.fit` names, over fresh processes, and the optimizer probe's
step peaks behind it.

    .venv/bin/python benchmarks/smallest_budget_spread.py [--arch llama-20m] [--seq 128]
        [--batch 2] [--processes 12] [--tag TAG]

Each process builds the model (random weights, fp32 under bf16 autocast), calls `fit` with
torch's AdamW, a disk tier and `ram="1MiB"`, and records the smallest budget of its one-line
refusal, the peak temporaries of each step of the optimizer probe that ran before the plan
(`profile/optimizer_probe.py`; it steps each of its two parameter sizes twice, where it stepped
them once before 2026-11-25; since 092413f it prices growing temporaries at the rate of the
step's own tensors and the RSS's excess over them as fixed bytes) and what the probe made
of them. The refusal tells a user what to give the next run, so its spread over processes
is what the `to_give` margin has to cover. Writes benchmarks/results/smallest-budget-spread-<date>[-TAG].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from harness import source_commit, write_results  # noqa: E402

from tierflow.cli import measure  # noqa: E402

# One process: fit refused at 1 MiB, with the probe's steps recorded. One JSON line.
CHILD = r"""
import json, sys, tempfile
import torch
import tierflow, tierflow.fitting.fit
import tierflow.profile.optimizer_probe as probe
from tierflow.cli import measure
arch, seq, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import tierflow.fitting.tiers
steps, priced = [], []
step, price = probe._probe_step, probe.probe_optimizer
def recorded_step(*args):
    steps.append(step(*args))
    return steps[-1]
def recorded_price(*args, **kwargs):
    priced.append(price(*args, **kwargs))
    return priced[-1]
probe._probe_step = recorded_step
tierflow.fitting.tiers.probe_optimizer = recorded_price
model = measure.build(arch, seq)
tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
record = {}
with tempfile.TemporaryDirectory() as disk:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tierflow.fit(model, {"input_ids": tokens, "labels": tokens}, ram=1 << 20, disk=disk,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    except tierflow.BudgetError as err:
        record["smallest"] = err.smallest
record["steps"] = [{"param_bytes": s.nbytes, "transient": s.transient, "tensors": s.tensors}
                   for s in steps]
record["per_byte"] = priced[0].transient_per_byte if priced else None
record["fixed"] = priced[0].transient_bytes if priced else None
print(json.dumps(record), flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(measure.ARCHS), default="llama-20m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--processes", type=int, default=12)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    mib = 2 ** 20
    runs = []
    for k in range(args.processes):
        run = measure.run_json([sys.executable, "-c", CHILD, args.arch, str(args.seq),
                                str(args.batch)],
                               env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        runs.append(run)
        peaks = ", ".join(f"{s['transient'] / mib:.1f}" for s in run["steps"])
        print(f"process {k + 1}: smallest {run['smallest'] / mib:.1f} MiB; probe steps' peaks "
              f"{peaks} MiB; priced {_priced(run)}", flush=True)
    smallest = [run["smallest"] / mib for run in runs]
    date = dt.date.today().isoformat()
    name = f"smallest-budget-spread-{date}" + (f"-{args.tag}" if args.tag else "")
    result = {"date": date, "commit": source_commit(ROOT), "arch": args.arch,
              "seq": args.seq, "batch": args.batch, "runs": runs}
    lines = [f"# The smallest budget fit names, over fresh processes ({date}, commit "
             f"{result['commit']})", "",
             f"{args.arch}, seq {args.seq}, batch {args.batch}, torch's AdamW, a disk tier, "
             f"`ram=\"1MiB\"`; {args.processes} fresh processes.", "",
             f"Smallest budget named: median {statistics.median(smallest):.1f} MiB, from "
             f"{min(smallest):.1f} to {max(smallest):.1f}.", "",
             "| process | smallest (MiB) | probe steps' peaks (MiB, by parameter size) | "
             "temporaries priced |", "|---|---|---|---|"]
    for k, run in enumerate(runs):
        peaks = ", ".join(f"{s['transient'] / mib:.1f} ({s['param_bytes'] / mib:.0f})"
                          for s in run["steps"])
        lines.append(f"| {k + 1} | {run['smallest'] / mib:.1f} | {peaks} | {_priced(run)} |")
    text = "\n".join(lines) + "\n"
    write_results(args.out, name, text, result)
    print(text)
    return 0


def _priced(run: dict) -> str:
    """How the probe priced the step's temporaries: per byte of the largest parameter, plus
    fixed bytes."""
    parts = [f"{run['per_byte']:.2f} bytes per byte"] if run["per_byte"] else []
    if run["fixed"] or not parts:
        parts.append(f"{run['fixed'] / 2 ** 20:.1f} MiB fixed")
    return " + ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
