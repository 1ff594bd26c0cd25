#!/usr/bin/env python3
"""Why fp8 on the CPU multiplies in fp32: on this machine, the seconds of one (512, K) x (K, K)
product of e4m3 operands through torch's CPU ``torch._scaled_mm``, through tierflow's
``scaled_matmul`` (an fp32 matmul of the same operands, what a CPU run uses) and of a bf16
matmul of the same shape, the median of five, for K = 64, 256 and 512.

    ./run python benchmarks/fp8_cpu_kernel.py [--tag TAG]

Writes benchmarks/results/fp8-cpu-kernel-<date>[-TAG].json (the CPU and torch named).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tierflow.precision.fp8 import E4M3, scaled_matmul
from tierflow.profile.machine import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = 512
REPEATS = 5


def seconds(work: Callable[[], object]) -> float:
    """The median of ``REPEATS`` timed calls, after one untimed."""
    work()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    one = torch.tensor(1.0)
    rows = []
    for k in (64, 256, 512):
        a = torch.randn(ROWS, k).to(E4M3)  # (512, K)
        b = torch.randn(k, k).to(E4M3).t().contiguous().t()  # (K, K), column-major
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        row = {"k": k,
               "scaled_mm_s": seconds(lambda: torch._scaled_mm(
                   a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
               "scaled_matmul_s": seconds(lambda: scaled_matmul(a, b, one, one)),
               "bf16_matmul_s": seconds(lambda: a16 @ b16)}
        row["scaled_mm_over_bf16"] = round(row["scaled_mm_s"] / row["bf16_matmul_s"], 1)
        row["scaled_matmul_over_bf16"] = round(row["scaled_matmul_s"] / row["bf16_matmul_s"], 1)
        rows.append(row)
        print(row, flush=True)
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    path = RESULTS / f"fp8-cpu-kernel-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "cpu": cpu_model(), "torch": torch.__version__,
                                "threads": torch.get_num_threads(), "rows": rows},
                               indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
