#!/usr/bin/env python3
"""How long a stage's read from the disk tier takes beside a thread running Python: the
read's thread needs the interpreter lock between its system calls (one per tensor), and the
interpreter hands the lock over every ``sys.getswitchinterval()`` seconds. The read is one
llama-134m decoder layer's fp32 weights (9 tensors, 28 MB) through the disk tier's store
(direct I/O where the file system allows it), repeated; beside it, in all but the first
row, a thread that runs a pure Python loop, at the default 5 ms interval and at the 0.5 ms
that tierflow's transfer threads set (``exec/io_threads.py``). Each row a fresh process.

    ./run python benchmarks/lock_wait.py [--dir DIR] [--repeats 20]

Reported: the median read, and how many loops per second the Python thread ran (what the
shorter interval costs it). Writes benchmarks/results/lock-wait-<date>.{md,json}.
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

from layer_passes import rows_in_a_directory, save

MODES = {"alone": None, "beside Python, 5 ms": 0.005, "beside Python, 0.5 ms": 0.0005}
HIDDEN, MLP = 768, 2048  # llama-134m


def measure(mode: str, directory: Path, repeats: int) -> dict:
    """In this process: the median read of a layer's weights with ``mode``'s thread."""
    import tierflow  # noqa: F401, I001  (first: torch then page-aligns large tensors)
    import torch
    from tierflow.exec.disk import DiskStore

    store = DiskStore(directory)
    shapes = [(HIDDEN, HIDDEN)] * 4 + [(MLP, HIDDEN)] * 2 + [(HIDDEN, MLP)] + [(HIDDEN,)] * 2
    tensors = [torch.randn(shape) for shape in shapes]
    store.write("layer", tensors)
    stop, loops = threading.Event(), [0]

    def python_loop() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1
            loops[0] += 1

    interval = MODES[mode]
    if interval is not None:
        sys.setswitchinterval(interval)
        threading.Thread(target=python_loop, daemon=True).start()
        time.sleep(0.2)
    reads, start, first = [], time.perf_counter(), loops[0]
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.read("layer", tensors)
        reads.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    stop.set()
    return {"mode": mode, "read_ms": statistics.median(reads) * 1e3,
            "megabytes": sum(t.nbytes for t in tensors) / 1e6, "direct": store.direct,
            "python_loops_per_s": (loops[0] - first) / elapsed if interval else None}


def main() -> None:
    measured = rows_in_a_directory(__file__, list(MODES), measure, 20, "the file goes")
    if measured is None:
        return
    rows, repeats = measured
    from tierflow.profile.machine import cpu_model
    lines = [f"# A disk read beside Python ({rows[0]['megabytes']:.1f} MB, 9 tensors)", "",
             f"{cpu_model()}; median of {repeats} reads; direct I/O: {rows[0]['direct']}; "
             "each row a fresh process. `benchmarks/lock_wait.py`.", "",
             "| thread beside the read, switch interval | read ms | vs alone | Python loops/s |",
             "|---|---|---|---|"]
    for r in rows:
        loops = f"{r['python_loops_per_s']:.0f}" if r["python_loops_per_s"] else "-"
        lines.append(f"| {r['mode']} | {r['read_ms']:.1f} | "
                     f"{r['read_ms'] / rows[0]['read_ms']:.2f}x | {loops} |")
    save("lock-wait", lines, [{**r, "cpu": cpu_model()} for r in rows])


if __name__ == "__main__":
    main()
