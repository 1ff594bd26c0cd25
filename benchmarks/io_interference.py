#!/usr/bin/env python3
"""What disk I/O on a background thread costs the compute beside it: one tinyllama-1.1b
decoder layer (hidden 2048, MLP 5632, 32 heads, 4 KV heads; batch 2, seq 1024, bf16
autocast) runs its forward without grad, its forward with grad and its backward (what a
checkpointed step does per layer) alone, then beside a thread that writes and reads a
256 MiB tensor through the disk tier's store without pause, through the page cache and past
it (O_DIRECT). Each configuration runs in a fresh process.

    ./run python benchmarks/io_interference.py [--dir DIR] [--repeats 6]

Reported: the median time of the three passes over the repeats after the first, the ratio to
the layer alone, and the disk bandwidth the thread got. Writes
benchmarks/results/io-interference-<date>.{md,json}.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from layer_passes import pass_table, rows_in_a_directory, save, time_layer_passes

MODES = ("alone", "page cache", "direct")


def measure(mode: str, directory: Path, repeats: int) -> dict:
    """In this process: the layer's pass times with ``mode``'s I/O thread beside it."""
    import tierflow  # noqa: F401, I001  (first: torch then page-aligns large tensors)
    import torch
    from tierflow.exec.disk import DiskStore

    stop, moved = threading.Event(), [0]

    def io(store: DiskStore) -> None:
        block = torch.ones(64 << 20)  # 256 MiB
        while not stop.is_set():
            store.write("block", [block])
            store.read("block", [block])
            moved[0] += 2 * block.nbytes

    if mode != "alone":
        store = DiskStore(directory, direct=mode == "direct")
        threading.Thread(target=io, args=(store,), daemon=True).start()
    start = time.perf_counter()
    row = time_layer_passes(repeats)
    elapsed = time.perf_counter() - start
    stop.set()
    return {"mode": mode, **row, "io_gb_s": moved[0] / elapsed / 1e9}


def main() -> None:
    measured = rows_in_a_directory(__file__, MODES, measure, 6, "the I/O thread's file goes")
    if measured is None:
        return
    rows, repeats = measured
    lines = pass_table("Disk I/O beside compute", __file__, "I/O thread beside it", rows,
                       repeats, ("disk GB/s", lambda r: f"{r['io_gb_s']:.2f}"))
    save("io-interference", lines, rows)


if __name__ == "__main__":
    main()
