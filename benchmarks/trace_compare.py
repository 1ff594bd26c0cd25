#!/usr/bin/env python3
"""A trace's measured spans against the plan's predicted ones (the `predicted` process that
`--trace` and `gpu_stream.py --trace` write beside them): per kind of op, the mean duration
of each, and per resource the busy seconds of a micro-batch, the first (warm-up) left out.

    ./run python benchmarks/trace_compare.py TRACE.json [TRACE.json ...]

Kinds: F (a forward without tape), Fall (with tape), B, U, and each transfer by what it
moves (load w, load s, store w, store s); the compute thread's waits for transfers are
counted apart, and left out of the op they happen inside (an Update waits for its optimizer
states inside its span). On a GPU the measured compute spans are the kernels' launches on
the host thread, not their run on the GPU. For the compute ops of one stage (F, Fall, B,
U) it also gives the median duration per stage, predicted (the stage times the plan
priced) and measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def kind(name: str) -> str:
    """``load(w3 disk>ram)`` -> ``load w``; ``Fall(3)`` -> ``Fall``."""
    head, _, rest = name.partition("(")
    return f"{head} {rest[0]}" if head in ("load", "store") and rest else head


STAGE_KINDS = ("F", "Fall", "B", "U")  # compute ops of one stage: ``Fall(3)`` is stage 3's


def stage_of(name: str) -> str | None:
    """``Fall(3)`` -> ``3``; None for an op that is not one stage's compute."""
    head, _, rest = name.partition("(")
    stage = rest.rstrip(")")
    return stage if head in STAGE_KINDS and stage.isdigit() else None


def compare(path: Path) -> dict:
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    measured, predicted = processes["measured"], processes.get("predicted")
    rows = {e["tid"]: e["args"]["name"] for e in events
            if e["name"] == "thread_name" and e["pid"] == measured}
    marks = sorted(e["ts"] for e in events if e["ph"] == "i" and e["name"] == "micro-batch")
    start, count = marks[1], len(marks) - 1  # after the warm-up micro-batch
    spans: dict[tuple[str, str], list[float]] = defaultdict(list)
    by_stage: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    busy: dict[tuple[str, str], float] = defaultdict(float)
    timed = [e for e in events
             if e["ph"] == "X" and e["ts"] >= start and e["pid"] in (measured, predicted)]
    waits = defaultdict(list)  # (pid, tid) -> the waits on that row
    for e in timed:
        if e["name"].startswith("wait for"):
            waits[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for e in timed:
        side = "measured" if e["pid"] == measured else "predicted"
        duration = e["dur"]
        if not e["name"].startswith("wait for"):  # less the waits inside it (an Update's
            end = e["ts"] + e["dur"]  # for its optimizer states)
            duration -= sum(max(0.0, min(end, b) - max(e["ts"], a))
                            for a, b in waits[e["pid"], e["tid"]])
            busy[side, rows[e["tid"]]] += duration / 1e6
        spans[side, kind(e["name"])].append(duration / 1e3)
        stage = stage_of(e["name"])
        if stage is not None:
            by_stage[side, kind(e["name"]), stage].append(duration / 1e3)
    kinds = sorted({k for _, k in spans})
    return {"trace": str(path), "micro_batches": count,
            "mean_ms": {k: {side: round(sum(spans[side, k]) / len(spans[side, k]), 2)
                            for side in ("predicted", "measured") if spans[side, k]}
                        for k in kinds},
            "busy_s_per_micro_batch": {row: {side: round(busy[side, row] / count, 3)
                                             for side in ("predicted", "measured")}
                                       for row in sorted({r for _, r in busy})},
            "median_ms_by_stage": _medians_by_stage(by_stage)}


def _medians_by_stage(by_stage: dict[tuple[str, str, str], list[float]]) -> dict:
    """{kind: {stage: {side: median ms}}}, stages in their order."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for op in STAGE_KINDS:
        stages = sorted({st for _, k, st in by_stage if k == op}, key=int)
        if stages:
            out[op] = {st: {side: round(statistics.median(by_stage[side, op, st]), 1)
                            for side in ("predicted", "measured") if by_stage[side, op, st]}
                       for st in stages}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    for path in parser.parse_args().traces:
        print(json.dumps(compare(path), indent=1))


if __name__ == "__main__":
    main()
