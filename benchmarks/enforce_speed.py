#!/usr/bin/env python3
"""What `--enforce` costs `tierflow train`: W2 under `--ram 4GiB --disk DIR` with and without
the memory cgroup, each run a fresh process, the two alternating.

    ./run python benchmarks/enforce_speed.py [--disk DIR] [--steps 3] [--repeats 2]
        [--model tinyllama-1.1b] [--ram 4GiB] [--seq 1024] [--batch 2] [--tag TAG] [--out DIR]

W2 is tinyllama-1.1b at random init, seq 1024, batch 2, bf16 autocast, AdamW (lr 1e-4, no
warm-up or clipping, weight decay 0.01: the settings of `train_w2.py` and `against_base.py`)
on random token ids (`random_tokens.py`), its model built onto the disk tier. The runs go
plain, enforce, plain, enforce, ... (`--repeats` of each), so that a change in the machine's
load reaches both. Each run's tok/s is batch x seq over the median of its steps after the
first; the ratio is the median of the `--enforce` runs' tok/s over the median of the plain
runs'. Reported per run: tok/s, the steps, the peak RSS above the post-import baseline (the
trainer's `ram` figure), the cgroup line the run printed (its limit), and whether the kernel
killed it (SIGKILL: the cgroup's out-of-memory killer) or it failed otherwise. Each run's
`--out` (its end-of-run checkpoint: 13 GB at W2) is removed once its log is read; the disk
tier, the token files and the outputs live in a temporary directory under `--disk` (default:
the system's). `--model`, `--ram`, `--seq` and `--batch` change the workload (a tiny preset
for a smoke test). Writes benchmarks/results/enforce-speed-<date>[-TAG].{json,md}, naming
the machine and the commit. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
from harness import machine, source_commit, write_results  # noqa: E402
from random_tokens import random_token_files  # noqa: E402

VOCAB = 32000
GIB = 2 ** 30
CONFIGS = ("plain", "enforce")


def train(config: str, args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    """One `tierflow train` run in a fresh process (``config`` "enforce": with --enforce)."""
    disk, out, log = work / "disk", work / "out", work / "log.jsonl"
    disk.mkdir(parents=True)
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", args.model, "--data", str(data),
           "--seq-len", str(args.seq), "--batch-size", str(args.batch), "--steps",
           str(args.steps), "--dtype", "bf16", "--lr", "1e-4", "--warmup", "0", "--clip", "0",
           "--weight-decay", "0.01", "--eval-every", "0", "--save-every", "0",
           "--ram", args.ram, "--disk", str(disk), "--out", str(out), "--log", str(log)]
    if config == "enforce":
        cmd.append("--enforce")
    load = os.getloadavg()[0]
    started = dt.datetime.now()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    wall = (dt.datetime.now() - started).total_seconds()
    records: dict[str, list[dict]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            records.setdefault(record["kind"], []).append(record)
    shutil.rmtree(work)  # the checkpoint (13 GB at W2), the disk tier, the log: read already
    cgroup = next((line for line in proc.stdout.splitlines() if "[memory cgroup]" in line), None)
    limit = re.search(r"memory\.(?:max|limit_in_bytes) ([\d.]+ [KMGT]?i?B)", cgroup or "")
    steps = [r["ms"] / 1e3 for r in records.get("train", [])]
    row: dict[str, Any] = {
        "config": config, "returncode": proc.returncode,
        "killed": proc.returncode == -9,  # SIGKILL: the cgroup's out-of-memory killer
        "cgroup": cgroup, "limit": limit[1] if limit else None,
        "steps_s": [round(s, 3) for s in steps], "wall_s": round(wall, 1),
        "load_before": round(load, 2)}
    if records.get("train"):
        row["peak_above_baseline_bytes"] = max(r["ram_bytes"] for r in records["train"])
    if proc.returncode == 0 and len(steps) >= 2:
        step = statistics.median(steps[1:])
        row.update(step_s=round(step, 3), tok_s=round(args.batch * args.seq / step, 2))
    elif proc.returncode != 0 and not row["killed"]:
        row["error"] = next((x for x in proc.stderr.splitlines()
                             if x.startswith("tierflow: error:")), proc.stderr.strip()[-500:])
    return row


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration the median tok/s of the runs that completed, and enforce / plain."""
    out: dict[str, Any] = {}
    for config in CONFIGS:
        done = [r["tok_s"] for r in runs if r["config"] == config and "tok_s" in r]
        out[config] = {"tok_s_median": statistics.median(done) if done else None,
                       "completed": len(done),
                       "killed": sum(r["killed"] for r in runs if r["config"] == config)}
    plain, enforced = out["plain"]["tok_s_median"], out["enforce"]["tok_s_median"]
    out["ratio_enforce_over_plain"] = round(enforced / plain, 4) if plain and enforced else None
    return out


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    ratio = s["ratio_enforce_over_plain"]
    lines = [f"# `--enforce` against plain: {result['model']} under --ram {result['ram']} "
             f"({result['date']}, {result['commit']})", "",
             f"machine: {json.dumps(result['machine'])}", "",
             f"seq {result['seq']}, batch {result['batch']}, bf16 autocast, `--disk`; "
             f"{result['steps']} steps per run, tok/s from the median after the first; each "
             "run a fresh process, alternating. `benchmarks/enforce_speed.py`.", "",
             f"tok/s enforce / plain: **{ratio if ratio is not None else '-'}** (medians: "
             f"plain {s['plain']['tok_s_median']}, enforce {s['enforce']['tok_s_median']})", "",
             "| # | config | tok/s | steps s | peak RSS above baseline | cgroup limit | killed "
             "by the kernel | load before |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"], 1):
        peak = r.get("peak_above_baseline_bytes")
        tok_s = r.get("tok_s", r.get("error", "-"))
        lines.append(f"| {i} | {r['config']} | {tok_s} | {', '.join(map(str, r['steps_s']))} | "
                     f"{f'{peak / GIB:.3f} GiB' if peak else '-'} | {r['limit'] or '-'} | "
                     f"{'yes' if r['killed'] else 'no'} | {r['load_before']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tinyllama-1.1b", help="a preset (default: W2's)")
    p.add_argument("--ram", default="4GiB")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    p.add_argument("--disk", default=None, help="where the disk tier, token files and outputs "
                   "go (default: the system's temporary directory)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step is not timed")
    date = dt.date.today().isoformat()
    runs = []
    with tempfile.TemporaryDirectory(dir=args.disk) as tmp:
        data = random_token_files(Path(tmp) / "data", VOCAB)
        for i in range(args.repeats):
            for config in CONFIGS:  # alternating: plain, enforce, plain, enforce, ...
                row = train(config, args, data, Path(tmp) / f"run-{i}-{config}")
                runs.append(row)
                print(f"{config} #{i + 1}: {row.get('tok_s', row.get('error', 'killed'))} tok/s, "
                      f"peak {row.get('peak_above_baseline_bytes', 0) / GIB:.3f} GiB, "
                      f"{row['cgroup'] or 'no cgroup'}", flush=True)
    result = {"date": date, "commit": source_commit(ROOT), "machine": machine(),
              "model": args.model, "ram": args.ram, "seq": args.seq, "batch": args.batch,
              "steps": args.steps, "repeats": args.repeats, "runs": runs,
              "summary": summary(runs)}
    name = f"enforce-speed-{date}" + (f"-{args.tag}" if args.tag else "")
    text = report(result)
    md, js = write_results(args.out, name, text, result)
    print(text)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
