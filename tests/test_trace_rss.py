"""The trace's ``host RSS`` counter follows the resident set while a recording is open."""
from __future__ import annotations

import time

import torch

from tierflow.exec.memory import return_free_memory
from tierflow.exec.trace import RSS_COUNTER, recording, span


def test_rss_counter_follows_an_allocation():
    return_free_memory()  # no malloc caches another thread (an RSS guard) could give back
    with recording() as recorder:
        time.sleep(0.02)
        with span("hold 256 MiB", "compute"):
            block = torch.ones(64 << 20)  # 256 MiB, every page touched
            time.sleep(0.05)
        del block
        time.sleep(0.05)
    points = [e for e in recorder.events if e["ph"] == "C" and e["name"] == RSS_COUNTER]
    assert len(points) >= 3
    values = [p["args"]["MiB"] for p in points]
    assert max(values) - values[0] >= 200  # the block shows
    assert values[-1] < max(values) - 200  # and its release
    held = next(e for e in recorder.events if e["ph"] == "X")
    top = max(points, key=lambda p: p["args"]["MiB"])
    assert held["ts"] <= top["ts"] <= held["ts"] + held["dur"]  # the peak falls in the span


def test_sampling_stops_with_the_recording():
    with recording() as recorder:
        pass
    count = len(recorder.events)
    time.sleep(0.02)
    assert len(recorder.events) == count
