#!/usr/bin/env python3
"""The compute ops of several `--trace` files side by side: per op (``Fall(3)``, ``B(3)``,
``U(3)``), the median of its measured durations over the steps after the first, and the sum of
those medians, for each trace; and each row's busy seconds per step (`trace_stats.py`'s).
Traces of the same run from two commits tell where one step is slower than the other; two
traces of the same commit tell how far a run differs from the next one on this machine (the
noise a ratio between commits has to clear).

    ./run python benchmarks/trace_ops.py NAME=TRACE.json [NAME=TRACE.json ...] [--json OUT]

Works with the traces of earlier commits too: it reads only the measured process's thread named
``compute`` (and ``optimizer``, where earlier commits put the Updates).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from trace_stats import measured_pid, trace_stats  # benchmarks/, beside this script

COMPUTE_THREADS = ("compute", "optimizer")


def op_medians(path: Path) -> tuple[dict[str, float], int]:
    """Milliseconds per compute op (the median over the steps after the first), and the
    trace's steps."""
    events = json.loads(path.read_text())["traceEvents"]
    pid = measured_pid(events)
    threads = {e["tid"] for e in events if e["name"] == "thread_name" and e["pid"] == pid
               and e["args"]["name"] in COMPUTE_THREADS}
    runs: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] == pid and e.get("tid") in threads \
                and re.fullmatch(r"(F|Fall|Fsel|B|U|Uh)\(\d+\)", e["name"]):
            runs[e["name"]].append(e["dur"] / 1e3)
    return ({name: statistics.median(durations[1:] or durations)
             for name, durations in runs.items()},
            max((len(durations) for durations in runs.values()), default=1))


def _order(name: str) -> tuple[str, int]:
    return name.split("(")[0], int(re.search(r"\d+", name).group())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", metavar="NAME=TRACE")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    named = dict(item.split("=", 1) for item in args.traces)
    medians, busy = {}, {}
    for name, path in named.items():
        medians[name], steps = op_medians(Path(path))
        busy[name] = trace_stats(Path(path), steps)  # each row's busy seconds per step
    ops = sorted({op for table in medians.values() for op in table}, key=_order)
    print("op".ljust(10) + "".join(name.rjust(12) for name in medians))
    for op in ops:
        print(op.ljust(10) + "".join(f"{table.get(op, 0.0):12.1f}" for table in medians.values()))
    sums = {name: round(sum(table.values()), 1) for name, table in medians.items()}
    print("sum".ljust(10) + "".join(f"{s:12.1f}" for s in sums.values()))
    for thread in sorted({t for threads in busy.values() for t in threads}):
        print(f"{thread} busy s per step: " + ", ".join(
            f"{name} {threads.get(thread, 0.0)}" for name, threads in busy.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"traces": named, "sum_ms": sums,
             "busy_s_per_step": busy,
             "op_ms": {name: {op: round(v, 1) for op, v in sorted(table.items(),
                                                                  key=lambda kv: _order(kv[0]))}
                       for name, table in medians.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
