"""``tierflow sweep``: ``tierflow plan`` over every combination of models, sequence lengths,
GPU memory and RAM, written as a CSV and heatmaps (the work is ``sim/sweep.py``'s)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .args import memory_bytes


def register(sub: Any) -> None:
    """Add ``tierflow sweep`` to the subcommands ``sub``."""
    from ..sim.options import add_setup_arguments
    sweep = sub.add_parser(
        "sweep", help="predicted tokens/s over models, sequence lengths, GPU memory and RAM",
        description="Predict every combination of --model, --seq-len, --gpu and --ram "
                    "(comma-separated lists) and write DIR/sweep.csv and one heatmap PNG of "
                    "predicted tokens/s over GPU memory x RAM per model and sequence length.")
    add_setup_arguments(sweep, lists=True)
    sweep.add_argument("-o", "--out", type=Path, required=True, metavar="DIR",
                       help="where sweep.csv and the PNGs go (created if missing)")
    sweep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the CSV and heatmaps; print one line per file."""
    from ..core.paths import require_writable_dir
    from ..sim.freeze import selection_for
    from ..sim.options import base_setup, hardware_from_args, positive_list
    from ..sim.shapes import load_shape
    from ..sim.sweep import sweep, write_csv, write_heatmaps
    gpus = [None] if args.gpu is None else [memory_bytes(v, "--gpu") for v in args.gpu.split(",")]
    rams = [None] if args.ram is None else [memory_bytes(v, "--ram") for v in args.ram.split(",")]
    out = require_writable_dir(args.out, "--out")
    specs = args.model.split(",")
    shapes = [load_shape(m) for m in specs]
    hw = hardware_from_args(args, lists=True)
    models = [(shape, selection_for(spec, args.freeze, args.train_only))
              for spec, shape in zip(specs, shapes)]
    seqs = positive_list(args.seq_len, "--seq-len")
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
