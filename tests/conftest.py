"""Test setup: the tiny models in tests/models.py, one intra-op thread (the test models are
far too small to gain from more, and a busy 2-core machine makes OpenMP thrash), a
tierflow cache of the test session's own (the user's ~/.cache is never written; the timings
a run keeps there are forgotten before each test), and the
``exclusive`` mark: with pytest-xdist's workers (pyproject's ``-n``), a test marked so runs
alone, while no other worker runs a test (it times itself, or measures the machine)."""
import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)


class _AlwaysQuiet:
    """``profile/machine.Quiet`` for the session's calibration: the other workers keep the
    CPUs busy, and a calibration refused for that would be measured again (some 20 s) by
    every test that plans on the cpu profile. What the suite checks never rests on its
    rates; a busy machine's refusal is tested with a stand-in measurement
    (tests/test_sim_cli.py)."""

    quiet = True

    def __enter__(self) -> "_AlwaysQuiet":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path_factory):
    """The session's cache, its matmul peaks and calibration kept from test to test, the
    timings a run keeps (a stage's, the optimizer's) forgotten before each: a test's fake or
    tiny stages share keys with another's."""
    from tierflow.profile.machine import forget_timings
    from tierflow.sim import calibrate
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setattr(calibrate, "Quiet", _AlwaysQuiet)
    forget_timings()


@pytest.fixture(scope="module")
def train_env(tmp_path_factory):
    """A tiny tokenized corpus and a tiny Llama saved with save_pretrained (one per test
    module): see ``cli_support.make_train_env``."""
    from cli_support import make_train_env
    return make_train_env(tmp_path_factory.mktemp("train"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test under a shared lock, an ``exclusive`` one under the sole lock."""
    with _turn(item.get_closest_marker("exclusive") is not None):
        yield


_LOCKS: dict[str, int] = {}  # this worker's open lock files


@contextlib.contextmanager
def _turn(exclusive: bool) -> Iterator[None]:
    """A readers-writer lock between the xdist workers of one run (nothing without xdist):
    each test passes the ``gate`` first, so a waiting exclusive test (holding the gate while
    the others' current tests finish) lets no other test start before it."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    if not _LOCKS:
        folder = Path(tempfile.gettempdir()) / f"tierflow-tests-{run}"
        folder.mkdir(exist_ok=True)
        for name in ("gate", "room"):
            _LOCKS[name] = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
    gate, room = _LOCKS["gate"], _LOCKS["room"]
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    if not exclusive:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
