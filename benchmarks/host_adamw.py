#!/usr/bin/env python3
"""The host AdamW against the memory bandwidth: tierflow's AdamW (precision/adamw.py, the
optimizer the trainer steps in host RAM) beside ``torch.optim.AdamW(fused=True)`` and
``foreach=True`` on the CPU, each configuration in a fresh process, in the same run.

    ./run python benchmarks/host_adamw.py [--elements 134217728] [--steps 5] [--tag TAG]

Parameters: ``--elements`` in 8 tensors of the shapes of a Llama layer's matrices (scaled),
with random gradients. Each process times ``--steps`` steps after one warm-up step (its
states allocated) and reports the median. The DRAM limit is measured in its own process as
the bandwidth of ``a += b`` over ``--elements`` fp32 values (two read, one written in place,
all cores: the access pattern of an optimizer step; a plain copy also reads the lines it
writes, which the bytes it names would not count). The bytes a
step must move per element are counted from the dtypes (the nominal traffic: weights, the
gradient and both moments read, weights and moments written; a fp32 master where kept), so
``GB/s`` is nominal bytes over time and ``of the limit`` that over the DRAM limit's.
Configurations:
- ``fp32``: fp32 weights, gradients and moments (28 bytes per element): tierflow (its
  compiled one-pass kernel), tierflow-unfused, torch fused, torch foreach;
- ``bf16-sr``: bf16 weights without a master copy (stochastic rounding), bf16 gradients and
  moments (14 bytes): tierflow (its compiled one-pass kernel, ``precision/fused_adamw.py``;
  the kernel's compilation is in the warm-up step), tierflow-unfused (the same arithmetic
  operation by operation, as where no kernel can be compiled), and torch fused over bf16
  weights and states (no stochastic rounding: not the same arithmetic, shown for its speed);
- ``bf16-master``: bf16 weights and gradients, fp32 master and moments (28 bytes): tierflow
  (its kernel) and tierflow-unfused.
Writes results/host-adamw-DATE[-TAG].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import machine, source_commit, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
# (name, implementation, weight dtype, state precision, nominal bytes per element)
CONFIGS = [
    ("fp32", "tierflow", "fp32", "fp32", 28),
    ("fp32", "tierflow-unfused", "fp32", "fp32", 28),
    ("fp32", "torch-fused", "fp32", "fp32", 28),
    ("fp32", "torch-foreach", "fp32", "fp32", 28),
    ("bf16-sr", "tierflow", "bf16", "bf16", 14),
    ("bf16-sr", "tierflow-unfused", "bf16", "bf16", 14),
    ("bf16-sr", "torch-fused", "bf16", "bf16", 14),
    ("bf16-master", "tierflow", "bf16", "fp32-master", 28),
    ("bf16-master", "tierflow-unfused", "bf16", "fp32-master", 28),
]
SHAPES = [(4, 4), (1, 4), (1, 4), (4, 4), (14, 4), (14, 4), (14, 4), (4, 1)]  # q k v o g u d n


def params_for(elements: int, dtype):
    """``elements`` values in tensors shaped like a Llama layer's (scaled down)."""
    import torch
    weight = sum(a * b for a, b in SHAPES)
    tensors = []
    for a, b in SHAPES:
        n = elements * a * b // weight
        tensors.append(torch.nn.Parameter(torch.randn(n, dtype=torch.float32).to(dtype)))
    for p in tensors:
        p.grad = torch.randn_like(p, dtype=torch.float32).to(dtype) * 1e-3
    return tensors


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process."""
    import torch
    from tierflow.precision.adamw import AdamW

    if args.one == "add":
        a, b = torch.randn(args.elements), torch.randn(args.elements)
        a.add_(b)
        times = []
        for _ in range(4 * args.steps):  # short: more of them
            start = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - start)
        s = statistics.median(times)
        return {"config": "add", "s": s, "gb_s": 3 * a.nbytes / s / 1e9}
    name, impl, weights, states, nominal = CONFIGS[int(args.one)]
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    params = params_for(args.elements, dtype)
    kw = dict(lr=1e-4, weight_decay=0.01)
    if impl == "tierflow-unfused":
        from tierflow.precision import adamw
        adamw.FUSED_MIN_ELEMENTS = adamw.FUSED_MIN_ELEMENTS_EXACT = 1 << 62  # never fused
    if impl.startswith("tierflow"):
        optimizer = AdamW(params, moment_dtype="fp32" if states != "bf16" else "bf16",
                          master="fp32" if states == "fp32-master" else "none", seed=0, **kw)
    else:
        optimizer = torch.optim.AdamW(params, fused=impl == "torch-fused",
                                      foreach=impl == "torch-foreach", **kw)
    optimizer.step()  # the states allocated
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    s = statistics.median(times)
    elements = sum(p.numel() for p in params)
    return {"config": name, "implementation": impl, "weights": weights, "states": states,
            "elements": elements, "s": s, "nominal_bytes_per_element": nominal,
            "gb_s": nominal * elements / s / 1e9, "steps_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 27)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tag", default="")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: add or a CONFIGS index
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for one in ["add", *map(str, range(len(CONFIGS)))]:
        proc = subprocess.run([sys.executable, __file__, "--one", one, "--elements",
                               str(args.elements), "--steps", str(args.steps)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"configuration {one} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    limit = rows[0]["gb_s"]
    fused = next(r for r in rows if r.get("implementation") == "torch-fused"
                 and r["config"] == "fp32")["s"]
    lines = ["| configuration | implementation | step (s) | GB/s (nominal) | of the limit | "
             "time vs torch fused fp32 |", "|---|---|---|---|---|---|",
             f"| a += b (the DRAM limit) | - | {rows[0]['s']:.3f} | {limit:.1f} | 1.00 | - |"]
    for r in rows[1:]:
        r["of_limit"] = r["gb_s"] / limit
        r["time_vs_torch_fused_fp32"] = r["s"] / fused
        lines.append(f"| {r['config']} | {r['implementation']} | {r['s']:.3f} | "
                     f"{r['gb_s']:.1f} | {r['of_limit']:.2f} | {r['time_vs_torch_fused_fp32']:.2f} |")
    date = dt.date.today().isoformat()
    name = f"host-adamw-{date}" + (f"-{args.tag}" if args.tag else "")
    text = (f"# Host AdamW against the memory bandwidth ({date})\n\n{args.elements:,} elements, "
            f"median of {args.steps} steps, each configuration in a fresh process.\n\n"
            + "\n".join(lines))
    write_results(args.results, name, text, {"date": date, "commit": source_commit(ROOT),
                                             "machine": machine(), "elements": args.elements,
                                             "steps": args.steps, "rows": rows})
    print(text)


if __name__ == "__main__":
    main()
