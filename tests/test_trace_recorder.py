"""The trace recorder's sums: a shared device's occupied time counts overlapping spans of its
rows once, and a wait for a transfer not at all (exec/trace.py)."""
import pytest

from tierflow.exec.trace import Recorder


def test_a_shared_devices_time_counts_its_rows_overlap_once():
    recorder = Recorder()
    at = recorder._start
    recorder.add("load(w1 disk>ram)", "disk read", at + 0.0, at + 3.0, {})
    recorder.add("store(w0 ram>disk)", "disk write", at + 2.0, at + 5.0, {})
    recorder.add("store(s0 ram>disk)", "disk write", at + 7.0, at + 8.0, {})
    recorder.add("wait for weights", "disk read", at + 8.0, at + 9.0, {})
    recorder.add("B(0)", "compute", at + 0.0, at + 9.0, {})
    assert recorder.working_seconds("disk read") + recorder.working_seconds("disk write") \
        == pytest.approx(7.0)
    assert recorder.occupied_seconds(["disk read", "disk write"]) == pytest.approx(6.0)


def test_a_wait_inside_an_ops_span_is_not_work():
    """An Update's span holds its wait for its optimizer states' read: the compute row's
    working time leaves that wait out, as the plan's timeline starts the Update after it."""
    recorder = Recorder()
    at = recorder._start
    recorder.add("U(3)", "compute", at + 1.0, at + 4.0, {})
    recorder.add("wait for optimizer states 3", "compute", at + 1.0, at + 3.0, {})
    recorder.add("B(2)", "compute", at + 4.0, at + 6.0, {})
    recorder.add("wait for weights", "compute", at + 6.0, at + 7.0, {})
    assert recorder.working_seconds("compute") == pytest.approx(3.0)
