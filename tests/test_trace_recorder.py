"""The trace recorder's sums: a shared device's occupied time counts overlapping spans of its
rows once, and a wait for a transfer not at all (exec/trace.py)."""
import pytest

from tierflow.exec.trace import Recorder


def _recorded(*spans: tuple[str, str, float, float]) -> Recorder:
    """A recorder holding ``spans`` (name, row, start and end seconds after it began)."""
    recorder = Recorder()
    for name, row, start, end in spans:
        recorder.add(name, row, recorder._start + start, recorder._start + end, {})
    return recorder


def test_a_shared_devices_time_counts_its_rows_overlap_once():
    recorder = _recorded(("load(w1 disk>ram)", "disk read", 0.0, 3.0),
                         ("store(w0 ram>disk)", "disk write", 2.0, 5.0),
                         ("store(s0 ram>disk)", "disk write", 7.0, 8.0),
                         ("wait for weights", "disk read", 8.0, 9.0),
                         ("B(0)", "compute", 0.0, 9.0))
    assert recorder.working_seconds("disk read") + recorder.working_seconds("disk write") \
        == pytest.approx(7.0)
    assert recorder.occupied_seconds(["disk read", "disk write"]) == pytest.approx(6.0)


def test_a_wait_inside_an_ops_span_is_not_work():
    """An Update's span holds its wait for its optimizer states' read: the compute row's
    working time leaves that wait out, as the plan's timeline starts the Update after it."""
    recorder = _recorded(("U(3)", "compute", 1.0, 4.0),
                         ("wait for optimizer states 3", "compute", 1.0, 3.0),
                         ("B(2)", "compute", 4.0, 6.0),
                         ("wait for weights", "compute", 6.0, 7.0))
    assert recorder.working_seconds("compute") == pytest.approx(3.0)


def test_the_predicted_process_carries_the_plans_bytes_at_each_compute_op(tmp_path):
    """``write`` with the plan's bytes per op: a ``plan bytes`` counter in the predicted
    process, per micro-batch, at each compute op's predicted start (its bytes while it runs)
    and end (after it), in MiB; transfers add no point."""
    import json

    from tierflow.exec.trace import MICRO_BATCH, PLAN_BYTES_COUNTER
    from tierflow.plan.timeline import Span, Timeline

    recorder = Recorder()
    recorder.mark(MICRO_BATCH, recorder._start + 1.0)
    predicted = Timeline((Span(0, "Fall(0)", "compute", 0.0, 2.0),
                          Span(1, "load(w1 disk>ram)", "disk read", 0.0, 1.0),
                          Span(2, "B(0)", "compute", 2.0, 5.0)), 5.0)
    mib = 1 << 20
    held = [(30 * mib, 20 * mib), (20 * mib, 20 * mib), (50 * mib, 10 * mib)]
    recorder.write(tmp_path / "trace.json", predicted, held)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    pid = next(e["pid"] for e in events if e["name"] == "process_name"
               and e["args"]["name"] == "predicted")
    points = [e for e in events if e["name"] == PLAN_BYTES_COUNTER]
    assert all(e["pid"] == pid for e in points)
    assert [e["ts"] / 1e6 for e in points] == pytest.approx([1.0, 3.0, 3.0, 6.0])
    assert [e["args"]["MiB"] for e in points] == [30, 20, 50, 10]
