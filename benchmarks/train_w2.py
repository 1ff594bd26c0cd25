#!/usr/bin/env python3
"""W2 (tinyllama-1.1b, seq 1024, batch 2, bf16 autocast, AdamW) trained by `tierflow train
--ram R --disk DIR` against Hugging Face gradient checkpointing, each in a fresh process.

    ./run python benchmarks/train_w2.py [--steps 3] [--runs 4GiB,4GiB:0,4GiB:serial,2GiB,8GiB]
                                        [--disk DIR] [--tag TAG]

The peer is `peers.py train --mode hf-ckpt --arch tinyllama-1.1b --seq 1024 --batch 2`
(AdamW lr 1e-4, no clipping). tierflow trains the same preset on random tokens with the same
optimizer settings (`--lr 1e-4 --warmup 0 --clip 0 --weight-decay 0.01`: torch's default),
its model built module by module onto the disk tier (it never exists whole in memory), once
per `--runs` entry RAM[:PREFETCH] (by default at 4 GiB with the prefetch depth the planner
chooses; with prefetch off, `--prefetch 0`: the plan made for reading nothing ahead, its
weights, optimizer states and tapes read when needed; with `serial` for PREFETCH,
`--serial-reads`: the planner's plan for its depth with every read on demand, the same
placement without the overlap; then at 2 and 8 GiB). Every run is
wrapped in `/usr/bin/time -v`; a run that fails is reported with its error line.

Reported per run: the median step time of the steps after the first (warm-up), tok/s and
the ratio to the peer, the peak RSS above the post-import baseline (the trainer's `ram` figure,
`ru_maxrss` minus the RSS after importing torch and transformers) next to `/usr/bin/time`'s
maximum RSS, the predicted step time and peak from the [Plan], and from a trace of every step
how long compute, the optimizer and the disk were busy and how long the compute waited for
streamed weights (`trace_stats.py`), and the spans running when the trace's RSS counter
peaked. The end-of-run checkpoint (weights and
AdamW states, written stage by stage from the disk tier) is timed too. Writes
benchmarks/results/train-w2-<date>[-TAG].{md,json} (and a Chrome trace per run).
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

from harness import predicted_ram_peak
from random_tokens import random_token_files
from trace_stats import ROWS, rss_peak, trace_stats

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers" / "peers.py"
RESULTS = ROOT / "benchmarks" / "results"
SEQ, BATCH, VOCAB = 1024, 2, 32000
SERIAL = "serial"  # a --runs PREFETCH: the planner's plan with every read on demand


def peer(steps: int) -> dict:
    cmd = [sys.executable, str(PEERS), "train", "--mode", "hf-ckpt", "--arch", "tinyllama-1.1b",
           "--seq", str(SEQ), "--batch", str(BATCH), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the peer failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"run": "peer: train-hf-ckpt", "step_s_median": row["step_s_median"],
            "tok_s": row["tok_s"], "peak_rss_gib": round(row["peak_rss_gib"]
                                                         - row["baseline_rss_gib"], 3)}


def tierflow(ram: str, prefetch: int | str | None, steps: int, data: Path, disk: Path,
             work: Path, stamp: str) -> dict:
    """One `tierflow train` run in a fresh process under /usr/bin/time -v (``prefetch`` None:
    the planner's choice; "serial": its plan with every read on demand)."""
    serial = prefetch == SERIAL
    name = f"--ram {ram}" + (" --serial-reads" if serial else
                             f" --prefetch {prefetch}" if prefetch is not None else "")
    depth = "auto" if prefetch is None else prefetch
    out, log = work / "out", work / "log.jsonl"
    trace = RESULTS / f"train-w2-{stamp}-{ram}-prefetch{depth}.trace.json"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "tierflow", "train",
           "--model", "tinyllama-1.1b", "--data", str(data), "--seq-len", str(SEQ),
           "--batch-size", str(BATCH), "--steps", str(steps), "--dtype", "bf16",
           "--lr", "1e-4", "--warmup", "0", "--clip", "0", "--weight-decay", "0.01",
           "--eval-every", "0", "--ram", ram, "--disk", str(disk),
           "--out", str(out), "--log", str(log), "--trace", str(trace)]
    if serial:
        cmd += ["--serial-reads"]
    elif prefetch is not None:
        cmd += ["--prefetch", str(prefetch)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    started = dt.datetime.now()
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = (dt.datetime.now() - started).total_seconds()
    if proc.returncode != 0:
        error = next((line for line in proc.stderr.splitlines()
                      if line.startswith("tierflow: error:")), proc.stderr.strip()[-500:])
        print(f"  {name}: failed ({proc.returncode}): {error}", flush=True)
        return {"run": f"tierflow {name}", "ram": ram, "prefetch": prefetch, "error": error}
    records: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    train = records["train"]
    step = statistics.median(r["ms"] / 1e3 for r in train[1:])
    plan = records["plan"][0]
    maxrss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)[1])
    busy = trace_stats(trace, len(train))
    print(f"  {name}: {wall:.0f} s, step {step:.1f} s (load {load:.1f} before)", flush=True)
    return {"run": f"tierflow {name}", "ram": ram, "prefetch": prefetch,
            "step_s_median": round(step, 2), "tok_s": round(BATCH * SEQ / step, 2),
            "steps_s": [round(r["ms"] / 1e3, 1) for r in train],
            "peak_rss_gib": round(max(r["ram_bytes"] for r in train) / 2**30, 3),
            "time_v_max_rss_gib": round(maxrss * 1024 / 2**30, 3),
            "time_v_above_baseline_gib": round(
                (maxrss * 1024 - records["system"][0]["rss_baseline_bytes"]) / 2**30, 3),
            "predicted_step_s": round(plan["predicted_step_s"], 1),
            "prefetch_depth": plan.get("prefetch_depth"),
            "predicted_peak_gib": round(predicted_ram_peak(plan) / 2**30, 3),
            "disk_gib": {k: round(v / 2**30, 2) for k, v in plan["disk_bytes"].items()},
            "busy_s_per_step": busy, "rss_peak": rss_peak(trace),
            "wall_s": round(wall), "load_before": round(load, 2),
            "checkpoints": len(records.get("checkpoint", [])),
            "trace": str(trace.relative_to(ROOT))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", default="4GiB,4GiB:0,4GiB:serial,2GiB,8GiB",
                        help="comma-separated RAM[:PREFETCH], one tierflow run each (no "
                             "PREFETCH: the planner chooses; serial: its plan with every "
                             "read on demand)")
    parser.add_argument("--disk", default=None, help="where the disk tier and checkpoints go "
                                                     "(default: a temporary directory)")
    parser.add_argument("--tag", default="", help="added to the result files' names, to keep "
                                                  "two runs of one day apart")
    parser.add_argument("--skip-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    rows = [] if args.skip_peer else [peer(args.steps)]
    if rows:
        print(f"  peer: step {rows[0]['step_s_median']} s", flush=True)
    configs = [(ram, (prefetch[0] if prefetch[0] == SERIAL else int(prefetch[0]))
                if prefetch else None)
               for ram, *prefetch in (run.split(":") for run in args.runs.split(","))]
    with tempfile.TemporaryDirectory(dir=args.disk) as tmp:
        data = random_token_files(Path(tmp) / "data", VOCAB)
        for ram, prefetch in configs:
            work = Path(tmp) / f"run-{ram}-{prefetch if prefetch is not None else 'auto'}"
            disk = work / "disk"
            disk.mkdir(parents=True)
            rows.append(tierflow(ram, prefetch, args.steps, data, disk, work, stamp))
            shutil.rmtree(work)  # the checkpoint: 13 GiB of weights and AdamW states
    peer_tok_s = rows[0]["tok_s"] if not args.skip_peer else None
    lines = [f"# W2 trained by `tierflow train --disk` ({stamp})", "",
             "tinyllama-1.1b, seq 1024, batch 2, bf16 autocast, fp32 weights and AdamW states; "
             f"each row a fresh process; median of the {args.steps - 1} steps after the first. "
             "Peak RSS is above the post-import baseline: over the steps (the trainer's "
             "figure) and over the whole run (`/usr/bin/time -v`).", "",
             "| run | tok/s | vs hf-ckpt | peak RSS GiB (steps) | time -v max RSS GiB (whole run, "
             "incl. the checkpoint) | prefetch depth | predicted step s "
             "| measured step s | busy per step: compute / optimizer / disk read / disk write (s) "
             "| compute waiting for weights per step (s) | load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['run']} | failed: {row['error']} |||||||||")
            continue
        busy = row.get("busy_s_per_step")
        ratio = f"{row['tok_s'] / peer_tok_s:.2f}x" if peer_tok_s else "-"
        lines.append(f"| {row['run']} | {row['tok_s']} | {ratio} | {row['peak_rss_gib']} | "
                     f"{row.get('time_v_above_baseline_gib', '-')} | "
                     f"{row.get('prefetch_depth', '-')} | {row.get('predicted_step_s', '-')} "
                     f"| {row['step_s_median']} | "
                     f"{' / '.join(str(busy[k]) for k in ROWS) if busy else '-'} | "
                     f"{busy.get('waiting for weights', '-') if busy else '-'} | "
                     f"{row.get('load_before', '-')} |")
    lines += overlap_lines(rows)
    (RESULTS / f"train-w2-{stamp}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"train-w2-{stamp}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


def overlap_lines(rows: list[dict]) -> list[str]:
    """A paragraph per budget run both with prefetch and without (depth 0, and the same plan
    with every read on demand): the ratios of their steps and the least ratio the main
    thread's own work allows."""
    lines: list[str] = []
    by_run = {(r["ram"], r["prefetch"]): r for r in rows if "prefetch" in r and "error" not in r}
    for (ram, prefetch), row in by_run.items():
        off = by_run.get((ram, 0))
        if prefetch != SERIAL and row["prefetch_depth"] and off is not None:
            on_s, off_s = row["step_s_median"], off["step_s_median"]
            busy = row["busy_s_per_step"]
            # compute and updates run one after the other on the main thread; only the reads
            # and writes can overlap them, so their sum bounds the step from below
            work = busy["compute"] - busy["waiting for weights"] + busy["optimizer"]
            lines += ["", f"Overlap at {ram}: with prefetch (depth {row['prefetch_depth']}) "
                          f"{on_s} s per step, without (depth 0: nothing read ahead) {off_s} s: "
                          f"{on_s / off_s:.2f}x. Without prefetch the compute waited "
                          f"{off['busy_s_per_step']['waiting for weights']} s per step for "
                          f"weights (tapes and optimizer states are waited for inside the "
                          f"backward and the update). With prefetch the main thread's own "
                          f"work, compute less its waits plus the optimizer, was {work:.1f} s "
                          f"per step (busy figures average all steps, the first included): "
                          f"no prefetch can make the step shorter, so "
                          f"{work / off_s:.2f}x is the least ratio here."]
            serial = by_run.get((ram, SERIAL))
            if serial is not None:
                serial_s = serial["step_s_median"]
                lines += ["", f"The same plan with every read on demand (`--serial-reads`: "
                              f"depth {row['prefetch_depth']}'s placement, nothing read ahead) "
                              f"took {serial_s} s per step: with prefetch {on_s / serial_s:.2f}x "
                              f"of that (the compute waited "
                              f"{serial['busy_s_per_step']['waiting for weights']} s per step "
                              f"for weights)."]
    return lines


if __name__ == "__main__":
    main()
