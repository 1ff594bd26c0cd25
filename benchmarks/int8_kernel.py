#!/usr/bin/env python3
"""Where `Int8Linear` switches from PyTorch's fused int8 kernel to converting the weight and
running the dtype's matmul: both timed on one weight, for a range of rows (tokens).

    .venv/bin/python benchmarks/int8_kernel.py [--shape 5632x2048] [--repeats 20]

The weight is int8 (out x in) with one scale per output row, as `tierflow quantize` writes it;
the input is `rows x in` in bf16 and fp32. Prints the median milliseconds of each path and
which is faster, per row count: `_FUSED_MAX_ROWS` in `src/tierflow/models/int8.py` comes from
this table (the fused kernel decodes; it is scalar in fp32).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ROWS = (1, 2, 4, 8, 16, 24, 32, 64, 128, 512)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="5632x2048", help="OUTxIN of the weight")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    n_out, n_in = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weight = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8)  # (out, in)
    print(f"int8 weight {n_out} x {n_in}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats, median ms")
    print("| dtype | rows | fused kernel | convert + matmul | faster |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        scales = torch.rand(n_out, dtype=dtype)
        for rows in ROWS:
            x = torch.randn(rows, n_in, dtype=dtype)  # (rows, in)
            fused = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, weight, scales),
                              args.repeats)
            matmul = median_ms(lambda: F.linear(x, weight.to(dtype)) * scales, args.repeats)
            faster = "fused" if fused < matmul else "matmul"
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {fused:.2f} | "
                  f"{matmul:.2f} | {faster} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
