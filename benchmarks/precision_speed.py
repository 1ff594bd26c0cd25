#!/usr/bin/env python3
"""Issue 5, speed: W1 (llama-134m, seq 1024, batch 4) tok/s with bf16 against fp32 matmuls,
and fp8 as this CPU runs it (emulated).

    .venv/bin/python benchmarks/precision_speed.py [--steps 3] [--work DIR]

Each configuration is ``tierflow train`` in a fresh process on random tokens (vocab 32000,
as ``train_speed.py``), no budget, fp32 weights and moments: only ``--matmul-dtype`` changes.
The first step is a warm-up; tok/s is the median over the next ``--steps``. A CPU has no fp8
matmul unit: ``torch._scaled_mm`` on the CPU converts the e4m3 operands and multiplies in a
wider type, so the fp8 row measures the emulation, not what fp8 buys; what it buys on a GPU is
not measured here. Writes benchmarks/results/precision-speed-<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from precision_common import load_average, machine, run_train, write_results
from random_tokens import random_token_files

VOCAB, SEQ, BATCH = 32000, 1024, 4
ROWS = [("fp32", "fp32 matmuls"), ("bf16-autocast", "bf16 autocast matmuls"),
        ("fp8", "fp8 e4m3 decoder matmuls (emulated on this CPU)")]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tierflow-precision-speed"))
    args = parser.parse_args()
    data = random_token_files(args.work / "data", VOCAB)
    common = ["--model", "llama-134m", "--data", str(data), "--seq-len", str(SEQ),
              "--batch-size", str(BATCH), "--steps", str(args.steps + 1), "--eval-every", "0"]
    print(f"precision speed: W1, load average {load_average()[0]:.2f}", flush=True)
    runs = {}
    for name, _ in ROWS:
        run = run_train(name, common, args.work)
        times = [r["ms"] / 1e3 for r in run["records"]["train"][1:]]
        median = statistics.median(times)
        runs[name] = {"step_s": times, "step_s_median": round(median, 3),
                      "tok_s": round(SEQ * BATCH / median, 1), "flags": run["flags"],
                      "load_before": run["load_before"],
                      "sol": [r.get("sol") for r in run["records"]["train"][1:]]}
    base = runs["fp32"]["tok_s"]
    info = machine()
    lines = ["# Precision speed (issue 5)", "",
             f"W1: llama-134m, seq {SEQ}, batch {BATCH}, random tokens, fp32 weights and AdamW "
             f"moments, no budget; median of {args.steps} steps after one warm-up, each "
             "configuration a fresh process (`benchmarks/precision_speed.py`).", "",
             "| matmuls | flags | step (median) | tok/s | vs fp32 | vs bf16 |",
             "|---|---|---|---|---|---|"]
    for name, what in ROWS:
        r = runs[name]
        r["ratio"] = round(r["tok_s"] / base, 3)
        r["ratio_to_bf16"] = round(r["tok_s"] / runs["bf16-autocast"]["tok_s"], 3)
        lines.append(f"| {what} | `{' '.join(r['flags'])}` | {r['step_s_median']:.2f} s | "
                     f"{r['tok_s']:.0f} | {r['ratio']:.2f}x | {r['ratio_to_bf16']:.2f}x |")
    loads = [r["load_before"][0] for r in runs.values()]
    lines += ["", f"Machine: {info['cpu']}, {info['cores']} cores, avx512_bf16 "
              f"{'yes' if info['avx512_bf16'] else 'no'}, AMX "
              f"{'yes' if info['amx_bf16'] else 'no'}; load average before each run "
              f"{min(loads):.2f}-{max(loads):.2f} (a shared machine: the load inflates the step "
              "times of every row). Without AMX a CPU's bf16 matmuls run on AVX-512 BF16 dot "
              "products, so bf16 is not the 3x or more that AMX gives. fp8 has no CPU hardware: "
              "the fp8 row runs the decoder Linears through the CPU's emulated "
              "`torch._scaled_mm` inside bf16 autocast (the rest of the model as the bf16 row), "
              "so its fair comparison is the vs-bf16 column: the emulation and the absmax "
              "scaling cost time, fp8 buys none here. No GPU gain is measured or claimed."]
    md, js = write_results("precision-speed", "\n".join(lines),
                           {"model": "llama-134m", "seq_len": SEQ, "batch_size": BATCH,
                            "steps": args.steps, "machine": info, "runs": runs})
    print("\n".join(lines))
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
