#!/usr/bin/env python3
"""What a `tierflow train --trace` file says about a step: seconds per step each thread row
was busy (compute, optimizer, disk read, disk write) and how long the compute waited for
streamed weights (the `wait for weights` spans, inside the compute row's time); and where the
highest point of the trace's `host RSS` counter fell: the spans running at that moment.

    ./run python benchmarks/trace_stats.py TRACE.json [TRACE.json ...] [--steps N]

`train_w2.py` reports these per run; this script reads them again from committed traces
(for example, to compare a run's waits with and without prefetch). ``--steps``: the steps
the trace holds (train_w2.py's runs: 3, the default), the divisor of every figure.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROWS = ("compute", "optimizer", "disk read", "disk write")
WAIT = "wait for weights"
RSS = "host RSS"  # the counter track of tierflow.exec.trace


def measured_pid(events: list[dict]) -> int:
    """The process of the measured spans: the first one (the plan's predicted timeline, where a
    trace holds it, is a process after it, with the same thread rows)."""
    return min(e["pid"] for e in events if "pid" in e)


def trace_stats(trace: Path, steps: int) -> dict[str, float]:
    """Per step: seconds each row of ``ROWS`` was busy, and the compute's waits for weights."""
    events = json.loads(trace.read_text())["traceEvents"]
    pid = measured_pid(events)
    tids = {e["args"]["name"]: e["tid"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
    stats = {row: sum(e["dur"] for e in spans if e["tid"] == tids[row]) / 1e6 / steps
             for row in ROWS}
    stats["waiting for weights"] = sum(e["dur"] for e in spans if e["name"] == WAIT) / 1e6 / steps
    return {key: round(value, 1) for key, value in stats.items()}


def rss_peak(trace: Path) -> dict[str, object]:
    """The highest point of the ``host RSS`` counter (MiB), its time in seconds from the
    trace's start, and the names of the spans running then (every row)."""
    events = json.loads(trace.read_text())["traceEvents"]
    points = [e for e in events if e["ph"] == "C" and e["name"] == RSS]
    if not points:
        return {}
    top = max(points, key=lambda e: e["args"]["MiB"])
    running = [e["name"] for e in events
               if e["ph"] == "X" and e["ts"] <= top["ts"] <= e["ts"] + e["dur"]]
    return {"MiB": top["args"]["MiB"], "at_s": round(top["ts"] / 1e6, 2), "during": running}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for trace in args.traces:
        stats = trace_stats(trace, args.steps)
        print(f"{trace.name}: " + ", ".join(f"{k} {v} s" for k, v in stats.items()))
        peak = rss_peak(trace)
        if peak:
            print(f"  RSS peak {peak['MiB']} MiB at {peak['at_s']} s, during "
                  f"{', '.join(peak['during']) or 'no span'}")


if __name__ == "__main__":
    main()
