"""``tierflow plan``, ``tierflow sweep`` and ``tierflow calibrate``: the simulator's commands.

The work is in ``tierflow.sim`` (``predict``, ``sweep``, ``calibrate``; ``sim/options.py``
holds the flags plan and sweep share), imported when a command runs, so that the other
commands start without it. ``cli.py`` registers these beside the others.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from .errors import TierflowError


def add_plan(sub: Any) -> None:
    """Register ``tierflow plan`` (the work is in tierflow.sim)."""
    from .sim.options import add_setup_arguments
    plan = sub.add_parser(
        "plan", help="predict a training run on some hardware: placement, peaks, tok/s",
        description="Predict, without running anything, how a model trains on a hardware "
                    "profile under memory budgets: where weights, gradients and optimizer "
                    "states live, what is recomputed or offloaded, the peak per tier, the step "
                    "time, tokens/s, MFU, the bottleneck and the smallest budgets that work. "
                    "Exit code 2 with one line when nothing fits.")
    add_setup_arguments(plan, lists=False)
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the predicted plan (or its JSON)."""
    from .sim.freeze import selection_for
    from .sim.options import base_setup, hardware_from_args, memory_size, one_positive
    from .sim.predict import predict
    from .sim.report import plan_text
    from .sim.shapes import load_shape
    shape = load_shape(args.model)
    hw = hardware_from_args(args, lists=False)
    seq = one_positive(args.seq_len, "--seq-len")
    setup = base_setup(args, hw, shape)
    gpu = memory_size(args.gpu, "--gpu") if args.gpu is not None else None
    ram = memory_size(args.ram, "--ram") if args.ram is not None else None
    selection = selection_for(args.model, args.freeze, args.train_only)
    prediction = predict(replace(setup, seq=seq, gpu=gpu, ram=ram, selection=selection))
    print(prediction.to_json() if args.json else plan_text(prediction, hw), flush=True)
    return 0


def add_sweep(sub: Any) -> None:
    """Register ``tierflow sweep`` (the work is in tierflow.sim.sweep)."""
    from .sim.options import add_setup_arguments
    sweep = sub.add_parser(
        "sweep", help="predicted tokens/s over models, sequence lengths, GPU memory and RAM",
        description="Predict every combination of --model, --seq-len, --gpu and --ram "
                    "(comma-separated lists) and write DIR/sweep.csv and one heatmap PNG of "
                    "predicted tokens/s over GPU memory x RAM per model and sequence length.")
    add_setup_arguments(sweep, lists=True)
    sweep.add_argument("-o", "--out", type=Path, required=True, metavar="DIR",
                       help="where sweep.csv and the PNGs go (created if missing)")
    sweep.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Write the CSV and heatmaps; print one line per file."""
    import time

    from .paths import require_writable_dir
    from .sim.freeze import selection_for
    from .sim.options import base_setup, hardware_from_args, memory_size, positive_list
    from .sim.shapes import load_shape
    from .sim.sweep import sweep, write_csv, write_heatmaps
    out = require_writable_dir(args.out, "--out")
    specs = args.model.split(",")
    shapes = [load_shape(m) for m in specs]
    hw = hardware_from_args(args, lists=True)
    models = [(shape, selection_for(spec, args.freeze, args.train_only))
              for spec, shape in zip(specs, shapes)]
    seqs = positive_list(args.seq_len, "--seq-len")
    gpus = [None] if args.gpu is None else [memory_size(v, "--gpu") for v in args.gpu.split(",")]
    rams = [None] if args.ram is None else [memory_size(v, "--ram") for v in args.ram.split(",")]
    base = base_setup(args, hw, shapes[0])
    started = time.perf_counter()
    cells = sweep(base, models, seqs, gpus, rams)
    write_csv(cells, out / "sweep.csv", base)
    pngs = write_heatmaps(cells, out, base)
    fits = sum(c.prediction is not None for c in cells)
    print(f"PREDICTED {len(cells)} configurations ({fits} fit) in "
          f"{time.perf_counter() - started:.1f} s: {out / 'sweep.csv'}", flush=True)
    for png in pngs:
        print(f"  heatmap {png}", flush=True)
    return 0


def add_calibrate(sub: Any) -> None:
    """Register ``tierflow calibrate`` (the work is in tierflow.sim.calibrate)."""
    cal = sub.add_parser(
        "calibrate", help="measure this machine for the cpu hardware profile",
        description="Measure this machine's peak matmul rate per dtype, memcpy and disk read "
                    "and write rates, cache them as the cpu hardware profile of tierflow plan "
                    "and print them.")
    cal.add_argument("--disk", type=Path, default=None, metavar="DIR",
                     help="where to time the disk (default: the tierflow cache directory)")
    cal.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .sim.calibrate import calibrate
    from .units import section
    if args.disk is not None and not args.disk.is_dir():
        raise TierflowError(f"--disk {args.disk} is not a directory: create it or give "
                            "another one")
    hw = calibrate(args.disk)
    print(section("Calibration (cpu profile, cached)", [
        ("machine", hw.about),
        *[(f"matmul {dtype}", f"{flops / 1e12:.3f} TFLOP/s") for dtype, flops in
          hw.peak_flops.items()],
        ("memcpy", f"{hw.memory_bw / 1e9:.1f} GB/s"),
        ("in a layer", f"matmuls at {hw.matmul_efficiency:.2f} of the peak, attention at "
         f"{hw.attention_efficiency:.2f}, element-wise at {hw.memory_efficiency:.2f} of memcpy"),
        ("AdamW", ", ".join(f"{bw / 1e9:.1f} GB/s ({moments} moments)"
                            for moments, bw in hw.optimizer_bw.items())
         + " of modelled traffic"),
        ("disk read", f"{hw.disk_read_bw / 1e9:.2f} GB/s"),
        ("disk write", f"{hw.disk_write_bw / 1e9:.2f} GB/s"),
        ("RAM", f"{hw.ram_bytes / 2**30:.1f} GiB" if hw.ram_bytes else "unknown")]), flush=True)
    return 0
