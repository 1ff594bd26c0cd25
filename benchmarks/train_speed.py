#!/usr/bin/env python3
"""`tierflow train` against plain PyTorch: llama-134m, seq 1024, batch 4, bf16, no budget.

    ./run python benchmarks/train_speed.py [--steps 4] [--peers PATH] [--eager]

In one run, each in a fresh process: the plain peer (`peers.py train --mode plain`) and
`tierflow train --model llama-134m` on random tokens (vocab 32000) written as a token file,
with the same shapes and optimizer (AdamW). Reports median tok/s after one warm-up step, the
ratio to the peer, and the SOL % the trainer printed. Writes
benchmarks/results/train-speed-<date>.{md,json}.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from random_tokens import random_token_files  # noqa: E402

from tierflow.cli import measure  # noqa: E402

VOCAB, SEQ, BATCH = 32000, 1024, 4



def run_tierflow(data: Path, out: Path, steps: int, compile: bool) -> dict:
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", "llama-134m", "--data", str(data),
           "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--steps", str(steps + 1),
           "--dtype", "bf16", "--eval-every", "0", "--out", str(out), "--log", str(out / "log.jsonl")]
    cmd += ["--compile"] if compile else []
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(["/bin/sh", "-c", '"$@"', "sh", *cmd], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tierflow train failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    times = [r["ms"] / 1e3 for r in train[1:]]  # the first step is warm-up (and compilation)
    median = statistics.median(times)
    return {"config": f"tierflow train{' --compile' if compile else ''}", "step_s": times,
            "step_s_median": round(median, 4), "tok_s": round(SEQ * BATCH / median, 1),
            "sol": [r.get("sol") for r in train[1:]],
            "printed": [line for line in proc.stdout.splitlines() if line.startswith("[T]")]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    p.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers" / "peers.py")
    p.add_argument("--eager", action="store_true", help="run tierflow without --compile")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    peer = measure.run_json([sys.executable, str(args.peers), "train", "--mode", "plain",
                             "--arch", "llama-134m", "--seq", str(SEQ), "--batch", str(BATCH),
                             "--steps", str(args.steps), "--dtype", "bf16"])
    with tempfile.TemporaryDirectory() as tmp:
        data = random_token_files(Path(tmp), VOCAB)
        ours = run_tierflow(data, Path(tmp) / "run", args.steps, not args.eager)
    ratio = ours["tok_s"] / peer["tok_s"]
    date = dt.date.today().isoformat()
    result = {"date": date, "peer": peer, "tierflow": ours, "ratio": round(ratio, 3),
              "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"train-speed-{date}.json").write_text(json.dumps(result, indent=1) + "\n")
    sol = [s for s in ours["sol"] if s is not None]
    text = "\n".join([
        f"# tierflow train speed ({date})", "",
        f"llama-134m, seq {SEQ} x batch {BATCH}, bf16 autocast, AdamW, no budget; median of "
        f"{args.steps} steps after one warm-up step; each in a fresh process.", "",
        "| config | median step (s) | tok/s | vs plain | SOL (printed) |", "|---|---|---|---|---|",
        f"| plain PyTorch (peer) | {peer['step_s_median']:.2f} | {peer['tok_s']:.0f} | 1.00x | — |",
        f"| {ours['config']} | {ours['step_s_median']:.2f} | {ours['tok_s']:.0f} | {ratio:.2f}x | "
        f"{statistics.median(sol) * 100:.1f}% |" if sol else "", "",
        "Lines the trainer printed:", "", "```", *ours["printed"], "```", ""])
    (args.out / f"train-speed-{date}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
