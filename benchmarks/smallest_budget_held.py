#!/usr/bin/env python3
"""Whether the budget `tierflow.fit` tells a user to give holds the steps' measured peak.

    .venv/bin/python benchmarks/smallest_budget_held.py [--arch llama-tiny] [--seq 128]
        [--batch 2] [--steps 3] [--runs 6] [--tag TAG]

As `tierflow compare --quick` does by default: each run asks `fit` (torch's AdamW, fp32) for
a budget no plan fits, takes the smallest it names with a new process's margin
(`core/units.with_rerun_margin`), and measures tierflow's steps under that budget in a
fresh process (`tierflow.cli.measure`: peak RSS above the post-import baseline, the run's
whole life). Records each run's budget, predicted and measured peak, and how many runs
passed their budget. Writes benchmarks/results/smallest-budget-held-<date>[-TAG].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from harness import machine, source_commit, write_results  # noqa: E402

from tierflow.cli import measure  # noqa: E402
from tierflow.core.units import with_rerun_margin  # noqa: E402

MIB = 1 << 20


def one_run(workload: measure.Workload) -> dict:
    """One refusal and one measured run under the budget it names, each a fresh process."""
    refused = measure.measure(workload, "tierflow", ram=MIB)
    if refused["status"] != "infeasible" or not refused.get("smallest"):
        raise SystemExit(f"expected a refusal naming the smallest budget, got {refused}")
    budget = with_rerun_margin(int(refused["smallest"]))
    run = measure.measure(workload, "tierflow", ram=budget)
    return {"smallest": int(refused["smallest"]), "budget": budget,
            "predicted_peak": run["predicted_peak_bytes"],
            "peak": run["peak_above_baseline_bytes"], "strategy": run["strategy"],
            "step_s_median": run["step_s_median"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llama-tiny", choices=sorted(measure.ARCHS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    workload = measure.Workload(args.arch, args.seq, args.batch, args.steps, "fp32")
    runs = []
    for i in range(args.runs):
        runs.append(one_run(workload))
        r = runs[-1]
        print(f"run {i + 1}: budget {r['budget'] / MIB:.2f} MiB, predicted "
              f"{r['predicted_peak'] / MIB:.2f}, measured {r['peak'] / MIB:.2f} MiB "
              f"({r['peak'] / r['budget']:.1%}), {r['strategy']}", flush=True)
    shares = [r["peak"] / r["budget"] for r in runs]
    errors = [r["predicted_peak"] / r["peak"] - 1 for r in runs]
    summary = {"runs": len(runs), "passed_budget": sum(s > 1 for s in shares),
               "peak_share_median": statistics.median(shares), "peak_share_max": max(shares),
               "predicted_error_median": statistics.median(errors),
               "predicted_error_min": min(errors)}
    lines = [f"# The smallest budget fit names, held? ({workload.describe()})", "",
             "| run | smallest | budget given | predicted peak | measured peak | of budget |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['smallest'] / MIB:.2f} MiB | {r['budget'] / MIB:.2f} MiB | "
              f"{r['predicted_peak'] / MIB:.2f} MiB | {r['peak'] / MIB:.2f} MiB | "
              f"{r['peak'] / r['budget']:.1%} |" for i, r in enumerate(runs)]
    lines += ["", f"{summary['passed_budget']} of {len(runs)} runs passed their budget; measured "
                  f"peak {summary['peak_share_median']:.1%} of the budget (median), "
                  f"{summary['peak_share_max']:.1%} at most; predicted peak "
                  f"{summary['predicted_error_median']:+.1%} vs measured (median), "
                  f"{summary['predicted_error_min']:+.1%} at the lowest."]
    text = "\n".join(lines) + "\n"
    print(text)
    name = f"smallest-budget-held-{dt.date.today()}" + (f"-{args.tag}" if args.tag else "")
    write_results(ROOT / "benchmarks" / "results", name, text, {
        "machine": machine(), "commit": source_commit(ROOT), "workload": vars(args),
        "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
