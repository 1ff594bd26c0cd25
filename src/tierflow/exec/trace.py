"""What the executor did and when, per resource, as Chrome-trace JSON (open it in Perfetto or
chrome://tracing) so that a user can see transfers overlapping compute.

Resources are rows: ``compute`` (stage forwards, backwards and updates on the calling thread,
and its waits for transfers), ``optimizer`` (the host RAM's updates and the deferred update
pass), ``disk read`` and ``disk write`` (the I/O threads of weights and optimizer states),
``copy up`` and ``copy down`` (weights moved between host RAM and a GPU, real or simulated),
``network`` (the plan's reductions of gradients over data-parallel workers). Beside
them a counter track, ``host RSS``, follows the process's resident set (sampled every few
milliseconds, a point wherever it moved by a MiB or more): where a step's memory peak falls
among its operations. Recording is off unless a ``recording()`` block is open; ``span`` then
costs one global lookup.

``Recorder.write`` can add the plan's predicted timeline (``plan/timeline.py``) as a second
process, ``predicted``, with the same rows and op names: one copy of it from the start of
each micro-batch the executor ran (``mark_micro_batch``), so that the predicted and the
measured spans of each op sit one above the other.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..plan.reductions import NETWORK
from ..plan.timeline import Timeline
from .memory import rss_bytes

_ROWS = ("compute", "optimizer", "host optimizer", "disk read", "disk write", "copy up",
         "copy down", NETWORK)
RSS_COUNTER = "host RSS"  # the counter track's name; its value is in MiB
PLAN_BYTES_COUNTER = "plan bytes"  # the predicted process's counter: the plan's held bytes
RSS_INTERVAL = 0.002  # seconds between RSS samples
RSS_STEP = 1 << 20  # bytes the RSS must move by to add a point
MICRO_BATCH = "micro-batch"  # the instant event that marks a micro-batch's start


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

    def mark(self, name: str, at: float) -> None:
        """An instant event ``name`` on the compute row at time ``at``."""
        event = {"name": name, "ph": "i", "s": "t", "pid": os.getpid(), "tid": 0,
                 "ts": (at - self._start) * 1e6}
        with self._lock:
            self.events.append(event)

    def working_seconds(self, row: str) -> float:
        """Time ``row`` was busy with work, not waiting for a transfer (the spans named
        "wait for ...", on their own or inside an op's span: an Update's for its optimizer
        states): what a plan's timeline predicts for that resource."""
        return self.occupied_seconds([row])

    def occupied_seconds(self, rows: Sequence[str]) -> float:
        """Time at least one of ``rows`` was busy with work, waits left out: a shared
        device's (a disk's reads and writes), which its rows' working seconds count twice
        where they overlap."""
        tids = {_ROWS.index(row) for row in rows}
        spans = [(e["ts"], e["ts"] + e["dur"], e["name"].startswith("wait for"))
                 for e in self.events if e.get("tid") in tids and e["ph"] == "X"]
        waits = _covered([(start, end) for start, end, wait in spans if wait])
        # the time of work outside any wait: |work and waits together| - |waits|
        return (_covered([(start, end) for start, end, _ in spans]) - waits) / 1e6

    def micro_batches(self) -> list[float]:
        """When each micro-batch began, in the trace's microseconds."""
        return [e["ts"] for e in self.events if e["name"] == MICRO_BATCH]

    def write(self, path: str | Path, predicted: Timeline | None = None,
              held: Sequence[tuple[int, int]] = ()) -> None:
        """The trace as Chrome-trace JSON; with ``predicted``, its spans (one micro-batch's)
        from the start of each micro-batch, as the process ``predicted``, and with ``held``
        (per op of the plan, the compute tier's bytes the plan predicts while it runs and
        after it, ``plan/simulate.py``) the counter track ``plan bytes`` there: at the start
        and the end of each compute op's predicted span."""
        measured = os.getpid()
        names = [{"name": "thread_name", "ph": "M", "pid": measured, "tid": i,
                  "args": {"name": row}} for i, row in enumerate(_ROWS)]
        names.append({"name": "process_name", "ph": "M", "pid": measured, "tid": 0,
                      "args": {"name": "measured"}})
        events = list(self.events)
        if predicted is not None:
            pid = measured + 10**7  # no process of this machine has it
            names += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": i,
                       "args": {"name": row}} for i, row in enumerate(_ROWS)]
            names.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                          "args": {"name": "predicted"}})
            for start in self.micro_batches():
                events += [{"name": s.name, "ph": "X", "pid": pid, "tid": _row(s.resource),
                            "ts": start + s.start * 1e6, "dur": (s.end - s.start) * 1e6}
                           for s in predicted.spans]
                if held:
                    events += _held_points(predicted, held, pid, start)
        Path(path).write_text(json.dumps({"traceEvents": names + events,
                                          "displayTimeUnit": "ms"}))


def _held_points(predicted: Timeline, held: Sequence[tuple[int, int]], pid: int,
                 start: float) -> list[dict]:
    """The ``plan bytes`` counter of one micro-batch from ``start`` (microseconds): each
    compute op's bytes while it runs from its span's start, and after it from its end."""
    points = []
    for s in predicted.spans:
        if s.resource != "compute" or s.position >= len(held):
            continue
        during, after = held[s.position]
        points += [(start + s.start * 1e6, during), (start + s.end * 1e6, after)]
    return [{"name": PLAN_BYTES_COUNTER, "ph": "C", "pid": pid, "ts": ts,
             "args": {"MiB": round(value / (1 << 20), 1)}} for ts, value in points]


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


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


def _row(resource: str) -> int:
    return _ROWS.index(resource) if resource in _ROWS else 0


def mark_micro_batch() -> None:
    """Mark a micro-batch's start when a recording is open."""
    recorder = _active
    if recorder is not None:
        recorder.mark(MICRO_BATCH, time.perf_counter())


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
