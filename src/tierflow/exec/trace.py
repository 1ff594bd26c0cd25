"""What the executor did and when, per resource, as Chrome-trace JSON (open it in Perfetto or
chrome://tracing) so that a user can see transfers overlapping compute.

Resources are rows: ``compute`` (stage forwards, backwards and updates on the calling thread),
``disk read`` and ``disk write`` (the I/O threads of weights and optimizer states),
``communication`` (gradients averaged over data-parallel workers before an update). Beside
them a counter track, ``host RSS``, follows the process's resident set (sampled every few
milliseconds, a point wherever it moved by a MiB or more): where a step's memory peak falls
among its operations. Recording is off unless a ``recording()`` block is open; ``span`` then
costs one global lookup.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .memory import rss_bytes

_ROWS = ("compute", "optimizer", "disk read", "disk write", "communication")
RSS_COUNTER = "host RSS"  # the counter track's name; its value is in MiB
RSS_INTERVAL = 0.002  # seconds between RSS samples
RSS_STEP = 1 << 20  # bytes the RSS must move by to add a point


class Recorder:
    """Complete events ("X") of one recording, from any thread."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._start = time.perf_counter()

    def add(self, name: str, row: str, start: float, end: float, args: dict) -> None:
        event = {"name": name, "ph": "X", "pid": os.getpid(), "tid": _ROWS.index(row),
                 "ts": (start - self._start) * 1e6, "dur": (end - start) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    def count(self, name: str, at: float, value: float) -> None:
        """A point of the counter track ``name`` at time ``at``."""
        event = {"name": name, "ph": "C", "pid": os.getpid(), "ts": (at - self._start) * 1e6,
                 "args": {"MiB": round(value, 1)}}
        with self._lock:
            self.events.append(event)

    def busy_seconds(self, row: str) -> float:
        """Total time ``row`` was busy (a summary for logs and tests)."""
        tid = _ROWS.index(row)
        return sum(e["dur"] for e in self.events if e["tid"] == tid) / 1e6

    def write(self, path: str | Path) -> None:
        names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": i,
                  "args": {"name": row}} for i, row in enumerate(_ROWS)]
        Path(path).write_text(json.dumps({"traceEvents": names + self.events,
                                          "displayTimeUnit": "ms"}))


_active: Recorder | None = None


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record every span until the block ends."""
    global _active
    previous, _active = _active, Recorder()
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(_active, stop), daemon=True,
                               name="tierflow-trace-rss")
    sampler.start()
    try:
        yield _active
    finally:
        stop.set()
        sampler.join()
        _active = previous


def _sample_rss(recorder: Recorder, stop: threading.Event) -> None:
    """Add a ``host RSS`` point whenever the RSS moved by ``RSS_STEP`` since the last one."""
    last = -RSS_STEP
    while True:
        rss = rss_bytes()
        if abs(rss - last) >= RSS_STEP:
            recorder.count(RSS_COUNTER, time.perf_counter(), rss / (1 << 20))
            last = rss
        if stop.wait(RSS_INTERVAL):
            return


@contextlib.contextmanager
def span(name: str, row: str, **args: object) -> Iterator[None]:
    """Time the block as ``name`` on ``row`` when a recording is open."""
    recorder = _active
    if recorder is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        recorder.add(name, row, start, time.perf_counter(), args)
