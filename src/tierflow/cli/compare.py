"""``tierflow compare``: fit a small Llama on random tokens under a RAM budget and measure
plain PyTorch and tierflow side by side, each in a fresh process (the first demo of the
project; the measuring is ``tierflow.cli.measure``'s)."""
from __future__ import annotations

import argparse
import time
from typing import Any

from ..core.config import PLANNERS
from ..core.units import format_bytes, format_margin, with_rerun_margin
from ..profile.machine import default_matmul_dtype
from . import measure
from .args import positive_int, size


def register(sub: Any) -> None:
    """Add ``tierflow compare`` to the subcommands ``sub``."""
    compare = sub.add_parser(
        "compare", help="fit a small Llama under a RAM budget; compare with plain PyTorch",
        description="Fit a small Llama-style model (random weights, random tokens) under a RAM "
                    "budget, print the plan, then measure plain PyTorch and tierflow, each in a "
                    "fresh process: peak RSS above the post-import baseline, median step time, "
                    "tokens/s and the loss of every step.")
    compare.add_argument("--ram", type=size, default=None, metavar="SIZE",
                         help="tierflow's RAM budget, e.g. 600MiB (default: half of plain "
                              "PyTorch's measured peak)")
    compare.add_argument("--arch", choices=sorted(measure.ARCHS), default=None,
                         help="model size (default llama-20m; llama-tiny with --quick)")
    compare.add_argument("--seq", type=positive_int, default=None,
                         help="sequence length (default 512)")
    compare.add_argument("--batch", type=positive_int, default=None,
                         help="batch size (default 4)")
    compare.add_argument("--steps", type=positive_int, default=None,
                         help="timed steps after one warm-up step (default 3)")
    compare.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                         help="bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16)")
    compare.add_argument("--planner", choices=PLANNERS, default="auto",
                         help="tierflow's planner (default auto: keep-all when it fits, else rotor)")
    compare.add_argument("--quick", action="store_true",
                         help="a tiny model and short sequences: a smoke test in seconds")
    compare.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``tierflow compare``: plain PyTorch, then tierflow under half its peak, each in a
    fresh process; with ``--ram``, tierflow under it first."""
    quick = args.quick
    dtype = args.dtype if args.dtype != "auto" else default_matmul_dtype()
    workload = measure.Workload(
        arch=args.arch or ("llama-tiny" if quick else "llama-20m"),
        seq=args.seq or (128 if quick else 512), batch=args.batch or (2 if quick else 4),
        steps=args.steps or (2 if quick else 3), dtype=dtype)
    print(f"tierflow compare: {workload.describe()}")
    print("each configuration runs in a fresh process; peak RSS is measured above the RSS "
          "right after imports", flush=True)

    # with --ram given, tierflow runs first: a budget that cannot work is refused before
    # plain PyTorch's run, which only the default budget needs beforehand
    plain = None if args.ram is not None else _plain(workload)
    budget, chosen = args.ram, "--ram"
    if plain is not None:
        budget, chosen = plain["peak_above_baseline_bytes"] // 2, "half of plain PyTorch's peak"
    _progress(f"tierflow under ram={format_bytes(budget)} ({chosen})")
    fitted = measure.measure(workload, "tierflow", ram=budget, planner=args.planner)
    if fitted["status"] == "infeasible":
        if args.ram is not None or not fitted.get("smallest"):
            raise measure.ChildUserError(fitted["error"])
        print(f"\n  {fitted['error']}\n  -> using the smallest budget that fits instead")
        # with the room the error asks for: a new process measures its runtime a little apart
        budget = with_rerun_margin(int(fitted["smallest"]))
        _progress(f"tierflow under ram={format_bytes(budget)} (the smallest feasible budget "
                  "and a new process's margin)")
        fitted = measure.measure(workload, "tierflow", ram=budget, planner=args.planner)
        if fitted["status"] == "infeasible":
            raise measure.ChildUserError(fitted["error"])
    _done(fitted)
    plain = plain if plain is not None else _plain(workload)
    print()
    print(fitted["explain"])
    print()
    print(comparison_table(plain, fitted, budget))
    return 0


def _plain(workload: measure.Workload) -> dict[str, Any]:
    """Plain PyTorch's run of ``workload``, in a fresh process."""
    _progress("plain PyTorch")
    plain = measure.measure(workload, "plain")
    _done(plain)
    return plain


def _progress(what: str) -> None:
    print(f"  measuring {what} ...", end="", flush=True)
    _progress.start = time.perf_counter()  # type: ignore[attr-defined]


def _done(record: dict[str, Any]) -> None:
    print(f" done in {time.perf_counter() - _progress.start:.0f} s", flush=True)  # type: ignore[attr-defined]


def comparison_table(plain: dict[str, Any], fitted: dict[str, Any], budget: int) -> str:
    """Plain PyTorch next to tierflow: peak, step time, tok/s, losses; predictions vs measured."""
    rows = [("", "peak RSS above baseline", "median step", "tok/s", "loss per step")]
    for name, r in (("plain PyTorch", plain), ("tierflow", fitted)):
        peak = format_bytes(r["peak_above_baseline_bytes"])
        if r is fitted:
            # one decimal: a peak within 0.5% of the budget is not "100%" either way
            peak += (f" ({r['peak_above_baseline_bytes'] / budget:.1%} of the "
                     f"{format_bytes(budget)} budget)")
        rows.append((name, peak, f"{r['step_s_median']:.3f} s", f"{r['tok_s']:,.0f}",
                     " ".join(f"{x:.4f}" for x in r["losses"])))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    pred_peak, pred_time = fitted["predicted_peak_bytes"], fitted["predicted_step_s"]
    lines.append("")
    lines.append(f"tierflow predicted peak {format_bytes(pred_peak)} "
                 f"({_err(pred_peak, fitted['peak_above_baseline_bytes'])} vs measured; "
                 f"margin {format_margin(pred_peak, budget)}), "
                 f"predicted step {pred_time:.3f} s ({_err(pred_time, fitted['step_s_median'])}); "
                 f"fit took {fitted['fit_s']:.1f} s")
    diff = max(abs(a - b) for a, b in zip(plain["losses"], fitted["losses"]))
    ratio = fitted["step_s_median"] / plain["step_s_median"]
    saved = 1 - fitted["peak_above_baseline_bytes"] / plain["peak_above_baseline_bytes"]
    lines.append(f"tierflow uses {abs(saved):.0%} {'less' if saved >= 0 else 'more'} memory than plain "
                 f"PyTorch at {ratio:.2f}x its step time; "
                 f"losses differ by at most {diff:.1e}")
    return "\n".join(lines)


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"
