#!/usr/bin/env python3
"""fit's own step prediction for W1 (llama-134m, seq 1024, batch 4, bf16 autocast, AdamW)
against the measured step, in one fresh `tierflow train` process.

    ./run python benchmarks/fit_prediction_w1.py [--steps 5] [--ram 5GiB] [--tag TAG]

`--disk DIR` makes fit own AdamW, so the [Plan]'s predicted step includes the updates made
inside the backward (without it the trainer's optimizer runs outside fit's plan); at 5 GiB
the plan keeps everything in RAM. Measured: the median of the steps after the first, on
random token ids. Writes benchmarks/results/fit-prediction-w1-<date>[-TAG].{md,json}.
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
from pathlib import Path

from harness import predicted_ram_peak
from random_tokens import random_token_files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ram", default="5GiB")
    parser.add_argument("--tag", default="", help="added to the result files' names, to keep "
                                                  "two runs of one day apart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = random_token_files(work / "data", 32000)
        (work / "disk").mkdir()
        log = work / "log.jsonl"
        cmd = [sys.executable, "-m", "tierflow", "train", "--model", "llama-134m",
               "--data", str(data), "--seq-len", "1024", "--batch-size", "4",
               "--steps", str(args.steps), "--dtype", "bf16", "--lr", "1e-4", "--warmup", "0",
               "--clip", "0", "--weight-decay", "0.01", "--eval-every", "0", "--ram", args.ram,
               "--disk", str(work / "disk"), "--out", str(work / "out"), "--log", str(log)]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in log.read_text().splitlines()]
    plan = next(r for r in records if r["kind"] == "plan")
    steps = [r["ms"] / 1e3 for r in records if r["kind"] == "train"]
    measured = statistics.median(steps[1:])
    predicted = plan["predicted_step_s"]
    peak = max(r["ram_bytes"] for r in records if r["kind"] == "train") / 2**30
    row = {"ram": args.ram, "strategy": plan["strategy"], "predicted_step_s": round(predicted, 2),
           "measured_step_s": round(measured, 2), "steps_s": [round(s, 2) for s in steps],
           "error": round(predicted / measured - 1, 3), "predicted_peak_gib":
           round(predicted_ram_peak(plan) / 2**30, 2), "peak_gib": round(peak, 2)}
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    lines = [f"# fit's step prediction for W1 ({stamp})", "",
             f"`tierflow train --model llama-134m --seq-len 1024 --batch-size 4 --dtype bf16 "
             f"--ram {args.ram} --disk DIR` ({args.steps} steps; measured: median of the steps "
             "after the first). `benchmarks/fit_prediction_w1.py`.", "",
             "| strategy | PREDICTED step s | measured step s | error | steps s | "
             "PREDICTED peak GiB | peak GiB |", "|---|---|---|---|---|---|---|",
             f"| {row['strategy']} | {row['predicted_step_s']} | {row['measured_step_s']} | "
             f"{row['error']:+.1%} | {row['steps_s']} | {row['predicted_peak_gib']} | "
             f"{row['peak_gib']} |"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"fit-prediction-w1-{stamp}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"fit-prediction-w1-{stamp}.json").write_text(json.dumps(row, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
