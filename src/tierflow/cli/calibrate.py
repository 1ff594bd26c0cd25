"""``tierflow calibrate``: measure this machine for the ``cpu`` hardware profile of ``tierflow
plan`` (the work is ``sim/calibrate.py``'s)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..core.errors import TierflowError


def register(sub: Any) -> None:
    """Add ``tierflow calibrate`` to the subcommands ``sub``."""
    cal = sub.add_parser(
        "calibrate", help="measure this machine for the cpu hardware profile",
        description="Measure this machine's peak matmul rate per dtype, memcpy and disk read "
                    "and write rates, cache them as the cpu hardware profile of tierflow plan "
                    "and print them. The stage, optimizer, disk and link timings that train "
                    "and plan --measure kept, and the measurements training runs kept for "
                    "plan --measure, are forgotten: the next run measures them again.")
    cal.add_argument("--disk", type=Path, default=None, metavar="DIR",
                     help="where to time the disk (default: the tierflow cache directory)")
    cal.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure, cache and print the cpu profile."""
    from ..core.units import section
    from ..profile.kept_profiles import forget_profiles
    from ..profile.machine import forget_timings
    from ..sim.calibrate import calibrate
    if args.disk is not None and not args.disk.is_dir():
        raise TierflowError(f"--disk {args.disk} is not a directory: create it or give "
                            "another one")
    forget_timings()
    forget_profiles()
    calibration = calibrate(args.disk)
    hw = calibration.profile
    kept = "cached" if calibration.kept else "not kept: the machine was busy"
    print(section(f"Calibration (cpu profile, {kept})", [
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
