#!/usr/bin/env python3
"""Where a training step's CPU time goes, thread by thread: W1 (llama-134m, seq 1024,
batch 4) trained by `tierflow train` under `--ram RAM` with a disk tier, in a fresh process
per tree, while this script reads every thread's user and system seconds and minor page
faults from /proc every second.

    ./run python benchmarks/thread_cpu.py --ram 1.583GiB [--base REF] [--steps 4]
        [--dtype fp32] [--tag TAG]

Reported per tree, over the steps after the first (from the end of step 1 to the end of the
last, by the run's log): the window's seconds, each thread's CPU seconds (user, system) and
minor faults, the main thread named as such and the others by their share, the machine's
page faults per second, and the steps' times. The compute threads are the main thread and
torch's intra-op workers; the rest are tierflow's own (I/O, the RSS guard) and torch's.
With `--base REF` the same run of REF's source (a temporary git worktree) runs first.
Writes benchmarks/results/thread-cpu-<date>[-TAG].json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from against_base import ROOT, VOCAB, commit_of
from random_tokens import random_token_files
from tierflow.profile.machine import cpu_model

RESULTS = ROOT / "benchmarks" / "results"
TICKS = os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[int, tuple[int, int, int]]:
    """Per thread of ``pid``: (minor faults, user ticks, system ticks)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[7]), int(fields[11]), int(fields[12]))
    return out


def machine_faults() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pgfault "):
            return int(line.split()[1])
    return 0


def sampled_run(tree: Path, args: argparse.Namespace, data: Path, work: Path) -> dict:
    """One `tierflow train` of ``tree``'s source, sampled every second until it exits."""
    disk, log = work / "disk", work / "log.jsonl"
    disk.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", "llama-134m", "--data",
           str(data), "--seq-len", "1024", "--batch-size", "4", "--steps", str(args.steps),
           "--dtype", args.dtype, "--lr", "1e-4", "--warmup", "0", "--clip", "0",
           "--eval-every", "0", "--save-every", "0", "--ram", args.ram, "--disk", str(disk),
           "--out", str(work / "out"), "--log", str(log)]
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    samples = []  # (time, machine faults, per-thread times)
    while proc.poll() is None:
        try:
            samples.append((time.time(), machine_faults(), thread_times(proc.pid)))
        except OSError:
            break  # the process ended between poll and read
        time.sleep(1.0)
    stderr = proc.communicate()[1]
    if proc.returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["?"])[-1]}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    shutil.rmtree(work, ignore_errors=True)  # the checkpoint and the disk tier
    return window(proc.pid, samples, [r for r in records if r["kind"] == "train"])


def window(pid: int, samples: list, steps: list[dict]) -> dict:
    """The threads' CPU over the steps after the first, from the samples nearest its ends."""
    begin, end = steps[0]["time"], steps[-1]["time"]
    first = min(samples, key=lambda s: abs(s[0] - begin))
    last = min(samples, key=lambda s: abs(s[0] - end))
    seconds = last[0] - first[0]
    threads = []
    for tid, (faults, user, system) in last[2].items():
        f0, u0, s0 = first[2].get(tid, (0, 0, 0))
        threads.append({"thread": "main" if tid == pid else "other",
                        "user_s": round((user - u0) / TICKS, 1),
                        "system_s": round((system - s0) / TICKS, 1),
                        "minor_faults": faults - f0})
    threads.sort(key=lambda t: -(t["user_s"] + t["system_s"]))
    return {"window_s": round(seconds, 1), "steps_s": [round(s["ms"] / 1e3, 3) for s in steps],
            "machine_faults_per_s": round((last[1] - first[1]) / seconds),
            "cpu_s": round(sum(t["user_s"] + t["system_s"] for t in threads), 1),
            "threads": [t for t in threads if t["user_s"] + t["system_s"] >= 0.1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ram", required=True, help="W1's --ram, e.g. 1.583GiB")
    parser.add_argument("--base", help="a git ref whose source runs the same first")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    result = {"date": stamp, "cpu": cpu_model(), "cores": os.cpu_count(), "ram": args.ram,
              "dtype": args.dtype, "head": commit_of(ROOT), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = random_token_files(tmp / "data", VOCAB)
        trees = {"head": ROOT}
        if args.base:
            base = tmp / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base],
                           cwd=ROOT, check=True, capture_output=True)
            trees = {"base": base, **trees}
            result["base"] = commit_of(base)
        try:
            for name, tree in trees.items():
                result["runs"][name] = sampled_run(tree, args, data, tmp / name)
                print(name, json.dumps(result["runs"][name]), flush=True)
        finally:
            if args.base:
                subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "base")],
                               cwd=ROOT, capture_output=True)
    out = RESULTS / f"thread-cpu-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
