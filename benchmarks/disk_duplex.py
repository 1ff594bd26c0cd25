#!/usr/bin/env python3
"""Whether a disk reads and writes at once at its full rate each, or shares one rate between
them: a 256 MiB write alone, a 256 MiB read alone, then the two side by side on two threads,
through the disk tier's store (``exec/disk.py``: synced writes, reads past the page cache).
The plan's timeline makes a disk's reads and writes take turns (``plan/streaming.py``,
``SHARED_DEVICE``): this is the measurement behind that.

    ./run python benchmarks/disk_duplex.py [--dir DIR] [--rounds 5]

Reported, as medians over the rounds: each direction's GiB/s alone and side by side, and the
time of both side by side against the sum of their times alone (1.0: they take turns; 0.5:
each runs at its full rate beside the other). Writes results/disk-duplex-<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import threading
import time
from pathlib import Path

from harness import machine, source_commit, write_results

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
NBYTES = 256 << 20


def one_round(store, read_buffer, write_buffer) -> dict[str, float]:
    """Seconds of a write alone, a read alone, and each of the two side by side."""
    def write() -> float:
        start = time.perf_counter()
        store.write("written", [write_buffer])
        return time.perf_counter() - start

    def read() -> float:
        start = time.perf_counter()
        store.read("read", [read_buffer])
        return time.perf_counter() - start

    alone = {"write": write(), "read": read()}
    together: dict[str, float] = {}
    threads = [threading.Thread(target=lambda: together.__setitem__("write", write())),
               threading.Thread(target=lambda: together.__setitem__("read", read()))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = time.perf_counter() - start
    return {"write_alone_s": alone["write"], "read_alone_s": alone["read"],
            "write_together_s": together["write"], "read_together_s": together["read"],
            "both_s": both}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch

    from tierflow.exec.disk import DiskStore
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierflow-duplex-") as tmp:
        store = DiskStore(tmp)
        read_buffer = torch.ones(NBYTES // 4)  # (NBYTES / 4,) fp32
        write_buffer = torch.ones(NBYTES // 4)
        store.write("read", [read_buffer])
        store.write("written", [write_buffer])
        rounds = [one_round(store, read_buffer, write_buffer) for _ in range(args.rounds)]
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    gib = NBYTES / GIB
    summary = {f"{key[:-2]}_gib_s": round(gib / seconds, 3)
               for key, seconds in median.items() if key != "both_s"}
    summary["both_over_sum_alone"] = round(
        median["both_s"] / (median["write_alone_s"] + median["read_alone_s"]), 3)
    stamp = dt.date.today().isoformat()
    data = {"date": stamp, "machine": machine(), "commit": source_commit(ROOT),
            "directory": str(args.dir or tempfile.gettempdir()), "bytes_each": NBYTES,
            "rounds": rounds, "median_s": median, "summary": summary}
    text = (f"# A disk's reads and writes side by side ({stamp})\n\n"
            f"{data['machine']['cpu']}, {data['directory']}, 256 MiB each way, medians of "
            f"{args.rounds} rounds. `benchmarks/disk_duplex.py`.\n\n"
            "| | write GiB/s | read GiB/s |\n|---|---|---|\n"
            f"| alone | {summary['write_alone_gib_s']} | {summary['read_alone_gib_s']} |\n"
            f"| side by side | {summary['write_together_gib_s']} | "
            f"{summary['read_together_gib_s']} |\n\n"
            f"Both side by side took {summary['both_over_sum_alone']}x the sum of their times "
            "alone (1.0: they take turns; 0.5: each at its full rate).\n")
    md, js = write_results(ROOT / "benchmarks" / "results", f"disk-duplex-{stamp}", text, data)
    print(text)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
