#!/usr/bin/env python3
"""What an exact RAM budget costs the compute: one tinyllama-1.1b decoder layer's three
passes (``layer_passes.py``) under glibc's default malloc thresholds, under the caching ones
(freed blocks under 32 MiB kept for reuse) and under the exact ones a budget that leaves no
room for malloc's caches sets (every block of 1 MiB and more its own mapping, returned at
once, so every large tensor is fresh memory that faults in; ``exec/memory.py``). Each in a
fresh process.

    ./run python benchmarks/allocator_cost.py [--repeats 6]

Writes benchmarks/results/allocator-cost-<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

from layer_passes import all_passes, time_layer_passes

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MODES = ("glibc default", "caching (32 MiB)", "exact (1 MiB)")


def measure(mode: str, repeats: int) -> dict:
    """In this process: the layer's pass times under ``mode``'s malloc thresholds."""
    import tierflow  # noqa: F401, I001  (first: as tierflow train runs, torch page-aligns)
    from tierflow.exec.memory import CACHING_THRESHOLD, EXACT_THRESHOLD, configure_host_allocator

    if mode != MODES[0]:
        configure_host_allocator(CACHING_THRESHOLD if mode == MODES[1] else EXACT_THRESHOLD)
    return {"mode": mode, **time_layer_passes(repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.repeats)))
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    base = rows[0]
    lines = ["# malloc thresholds and compute (" + dt.date.today().isoformat() + ")", "",
             "One tinyllama-1.1b decoder layer, batch 2, seq 1024, bf16 autocast, "
             f"{base['threads']} compute threads; medians of {args.repeats - 1} repeats; each "
             "row a fresh process. `benchmarks/allocator_cost.py`.", "",
             "| malloc thresholds | forward s | forward with grad s | backward s | "
             "all three vs default |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['forward_s']:.3f} | {r['forward_grad_s']:.3f} | "
                     f"{r['backward_s']:.3f} | {all_passes(r) / all_passes(base):.2f}x |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"allocator-cost-{dt.date.today().isoformat()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
