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
import json

from layer_passes import in_fresh_processes, pass_table, save, time_layer_passes

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
    rows = in_fresh_processes(__file__, MODES, ["--repeats", str(args.repeats)])
    save("allocator-cost", pass_table("malloc thresholds and compute", __file__,
                                      "malloc thresholds", rows, args.repeats), rows)


if __name__ == "__main__":
    main()
