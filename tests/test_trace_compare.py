"""benchmarks/trace_compare.py on a small trace of two micro-batches: per kind the mean span
and, per stage, the median of its compute ops, predicted and measured, the warm-up
micro-batch left out."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _trace_compare():
    spec = importlib.util.spec_from_file_location("trace_compare",
                                                  ROOT / "benchmarks" / "trace_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _span(pid: int, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}


def _name(what: str, pid: int, name: str) -> dict:
    """A metadata event naming a process or its thread 1."""
    return {"ph": "M", "name": what, "pid": pid, "tid": 1, "args": {"name": name}}


def test_medians_per_stage_leave_the_warm_up_out(tmp_path) -> None:
    measured, predicted = 1, 2
    events = [_name("process_name", measured, "measured"),
              _name("process_name", predicted, "predicted"),
              _name("thread_name", measured, "compute"),
              _name("thread_name", predicted, "compute")]
    for start in (0.0, 10_000.0, 20_000.0):  # warm-up, then two micro-batches (µs)
        events.append({"ph": "i", "name": "micro-batch", "pid": measured, "ts": start})
        warm = start == 0.0
        events += [_span(measured, "Fall(1)", start, 9000.0 if warm else 1000.0 + start / 10),
                   _span(measured, "B(1)", start + 3000, 3000.0),
                   _span(predicted, "Fall(1)", start, 1500.0),
                   _span(predicted, "B(1)", start + 3000, 2500.0),
                   _span(measured, "load(w1 disk>ram)", start, 500.0)]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    result = _trace_compare().compare(path)
    assert result["micro_batches"] == 2
    # measured Fall(1): 2000 and 3000 µs after the warm-up's 9000
    assert result["median_ms_by_stage"]["Fall"]["1"] == {"predicted": 1.5, "measured": 2.5}
    assert result["median_ms_by_stage"]["B"]["1"] == {"predicted": 2.5, "measured": 3.0}
    assert "load w" in result["mean_ms"] and "load" not in result["median_ms_by_stage"]
