#!/usr/bin/env python3
"""Issue 5, quality: final eval loss of each precision relative to fp32 everything.

    .venv/bin/python benchmarks/precision_quality.py [--steps 300] [--seq-len 256]
        [--batch-size 4] [--jobs 2] [--work DIR] [--only NAME ...]

The embedded default corpus (the Python standard library's source, tokenized with a byte-level
BPE of 4096 ids trained on it, as ``tierflow demo`` does), preset ``llama-20m``, the same seed,
data order and learning-rate schedule (peak 1e-3, 5% warmup, cosine to 1e-4) for every
configuration; each configuration trains in a fresh process, ``--jobs`` of them at a time
with 2 / jobs threads each (one thread per process keeps a shared machine's other load from
stalling OpenMP's thread barriers; the losses do not depend on it). The eval loss is the mean over
the same 8 eval batches after the last step. Acceptance bands (issue 5): bf16 autocast with an
fp32 master <= +1%; bf16 weights with stochastic rounding and bf16 moments <= +2%; int8
moments <= +2%; fp8 matmuls <= +3%. Writes benchmarks/results/precision-quality-<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import io
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from precision_common import ROOT, load_average, machine, run_train, write_results

# (configuration, acceptance band in % over fp32, what it is)
ROWS = [
    ("fp32", None, "fp32 weights, moments and matmuls (the reference)"),
    ("bf16-autocast", 1.0, "bf16 autocast matmuls, fp32 weights as the master"),
    ("bf16-weights-fp32-master", 1.0, "bf16 weights, fp32 master copy, bf16 matmuls"),
    ("bf16-sr-bf16-moments", 2.0, "bf16 weights by stochastic rounding, bf16 moments"),
    ("int8-moments", 2.0, "blockwise int8 moments, fp32 weights, bf16 matmuls"),
    ("bf16-sr-int8-moments", None, "the 6-byte mode: bf16 weights by SR, int8 moments"),
    ("fp8", 3.0, "fp8 e4m3 decoder matmuls (bf16 gradients), fp32 weights"),
]


def prepare_data(work: Path) -> Path:
    """The stdlib corpus as token files under WORK/data (reused when already there)."""
    sys.path.insert(0, str(ROOT / "src"))
    from tierflow.data import STDLIB
    from tierflow.data.tokenize import tokenize
    data = work / "data"
    if not (data / "meta.json").is_file():
        tokenize([STDLIB], data, vocab_size=4096, log=io.StringIO())
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2, help="configurations run at a time")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tierflow-precision-quality"))
    parser.add_argument("--only", nargs="*", help="configurations to run (fp32 always runs)")
    args = parser.parse_args()
    data = prepare_data(args.work)
    rows = [r for r in ROWS if not args.only or r[0] == "fp32" or r[0] in args.only]
    common = ["--model", "llama-20m", "--data", str(data), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", "1e-3",
              "--seed", "0", "--eval-every", str(args.steps), "--eval-steps", "8"]
    print(f"precision quality: llama-20m, {args.steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens; load average {load_average()[0]:.2f}", flush=True)
    threads = max(1, 2 // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        slowest_first = sorted(rows, key=lambda row: row[0] != "fp8")  # fp8 is emulated
        done = dict(zip([r[0] for r in slowest_first], pool.map(
            lambda row: run_train(row[0], common, args.work, threads=threads), slowest_first)))
    runs = {}
    for name, _, _ in rows:
        run = done[name]
        runs[name] = {"eval_loss": run["records"]["eval"][-1]["loss"],
                      "train_loss_last": run["records"]["train"][-1]["loss"],
                      "wall_s": run["wall_s"], "load_before": run["load_before"],
                      "flags": run["flags"],
                      "bytes_per_parameter": run["records"]["plan"][0]["bytes_per_parameter"]}
    reference = runs["fp32"]["eval_loss"]
    lines = ["# Precision quality (issue 5)", "",
             f"llama-20m on the stdlib corpus (BPE 4096), {args.steps} steps of "
             f"{args.batch_size} x {args.seq_len} tokens, lr 1e-3 cosine, seed 0; eval loss over "
             "the same 8 eval batches after the last step; each configuration a fresh process "
             f"with {threads} thread(s), {args.jobs} at a time "
             "(`benchmarks/precision_quality.py`).", "",
             "| configuration | flags | B/param | eval loss | vs fp32 | band | pass | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for name, band, what in rows:
        r = runs[name]
        rel = 100 * (r["eval_loss"] / reference - 1)
        r["relative_pct"] = round(rel, 3)
        r["band_pct"] = band
        r["passes"] = None if band is None else rel <= band
        verdict = "-" if band is None else ("yes" if rel <= band else "**no**")
        lines.append(f"| {name} ({what}) | `{' '.join(r['flags'])}` | "
                     f"{r['bytes_per_parameter']['total']:g} | {r['eval_loss']:.4f} | "
                     f"{rel:+.2f}% | {'-' if band is None else f'<= +{band:g}%'} | {verdict} | "
                     f"{r['wall_s']:.0f} s |")
    loads = [r["load_before"][0] for r in runs.values()]
    lines += ["", f"Machine: {machine()['cpu']}, {machine()['cores']} cores; load average "
              f"before each run {min(loads):.2f}-{max(loads):.2f} (the machine is shared; the "
              "losses do not depend on it, the wall times do). fp8 runs through "
              "`torch._scaled_mm` on the CPU, which emulates it."]
    md, js = write_results("precision-quality", "\n".join(lines),
                           {"steps": args.steps, "seq_len": args.seq_len,
                            "batch_size": args.batch_size, "model": "llama-20m",
                            "jobs": args.jobs, "threads_per_run": threads,
                            "machine": machine(), "runs": runs})
    print("\n".join(lines))
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
