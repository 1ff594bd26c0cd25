"""Timings kept between processes (profile/machine.py's kept figures): a stage's forward and
backward, the optimizer's seconds per byte, a disk's and the link's rates are measured once
while the CPUs are quiet, and every later profile uses the kept figures while it measures
bytes anew, so that two processes plan from the same times. The in-process stage cache is
cleared to stand for a new process."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from tierflow.chain import to_chain
from tierflow.exec.context import AutocastMode
from tierflow.exec.memory import HostMeter
from tierflow.precision.adamw import AdamW
from tierflow.profile import machine, optimizer_probe, profiler


@pytest.fixture
def quiet(monkeypatch):
    """Other processes never busy: a shared CI machine's would keep nothing."""
    monkeypatch.setattr(machine, "_others_were_busy", lambda before, after: False)


def _profile(monkeypatch, fwd: float, bwd: float, tape: int,
             rounds: list | None = None) -> profiler.StageCost:
    """A new process's profile of one linear stage whose rounds take ``fwd`` and ``bwd``
    seconds and keep ``tape`` bytes; each round's meter goes to ``rounds`` when given."""
    def fake_round(run, meter, ledger, selective=False):
        if rounds is not None:
            rounds.append(meter)
        return profiler._Measured(fwd_time=fwd, bwd_time=bwd, output_bytes=0, tape=tape,
                                  output_in_tape=False, fwd_transient=0,
                                  fwd_transient_nograd=0, bwd_transient=0, largest_block=0)

    monkeypatch.setattr(profiler, "measure_round", fake_round)
    monkeypatch.setattr(profiler, "_CACHE", {})
    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    measuring = profiler.Measuring(HostMeter(), repeats=2, selective=False)
    costs, _ = profiler.profile_chain(to_chain(model, x), x, {}, AutocastMode.capture("cpu"),
                                      measuring)
    return costs[0]


def test_a_later_profile_takes_the_kept_times_and_its_own_bytes(monkeypatch, quiet):
    first = _profile(monkeypatch, 0.2, 0.3, tape=100)
    later = _profile(monkeypatch, 0.5, 0.9, tape=200)
    assert (later.fwd_time, later.bwd_time) == (first.fwd_time, first.bwd_time) == (0.2, 0.3)
    assert later.tape == 200


def test_a_later_profile_runs_no_timed_rounds_where_times_were_kept(monkeypatch, quiet):
    """Kept times replace a profile's own, so a later process runs only the rounds that
    measure bytes (a warm-up and ``repeats``, on the meter with the RSS sampler): W1's
    fused LM head took 4 s a round and 6 rounds a profile."""
    first, later = [], []
    _profile(monkeypatch, 0.2, 0.3, tape=100, rounds=first)
    cost = _profile(monkeypatch, 0.5, 0.9, tape=100, rounds=later)
    assert (cost.fwd_time, cost.bwd_time) == (0.2, 0.3)
    assert len(later) == 3 < len(first)  # the warm-up and two memory rounds
    assert all(meter.interval is not None for meter in later)  # none timed without the sampler


def test_times_measured_while_others_were_busy_are_not_kept(monkeypatch):
    monkeypatch.setattr(machine, "_others_were_busy", lambda before, after: True)
    _profile(monkeypatch, 0.2, 0.3, tape=100)
    later = _profile(monkeypatch, 0.5, 0.9, tape=100)
    assert (later.fwd_time, later.bwd_time) == (0.5, 0.9)


def test_calibrate_forgets_the_timings_but_not_the_matmul_peaks(monkeypatch, quiet):
    machine.keep("matmul", "fp32", 1e12)
    _profile(monkeypatch, 0.2, 0.3, tape=100)
    machine.forget_timings()
    assert _profile(monkeypatch, 0.5, 0.9, tape=100).fwd_time == 0.5
    assert machine.recalled("matmul", "fp32") == 1e12


def test_another_machine_key_measures_again(monkeypatch, quiet):
    _profile(monkeypatch, 0.2, 0.3, tape=100)
    monkeypatch.setattr(machine, "cpu_identity", lambda: "another CPU|bf16 native")
    assert _profile(monkeypatch, 0.5, 0.9, tape=100).fwd_time == 0.5


def test_the_optimizer_keeps_its_rate_whatever_its_learning_rate(monkeypatch, quiet):
    """The probe's seconds per byte is kept per optimizer class and flags; a learning rate
    changes no work. A different moment dtype is another optimizer's rate."""
    seconds = itertools.count(1)
    real = optimizer_probe._probe_step

    def timed_step(*args):
        step = real(*args)
        return optimizer_probe._Step(step.state, float(next(seconds)), step.transient,
                                     step.nbytes, step.tensors)

    monkeypatch.setattr(optimizer_probe, "_probe_step", timed_step)

    def rate(lr: float, moments: str = "fp32") -> float:
        probe = optimizer_probe.probe_optimizer(
            lambda params: AdamW(params, lr=lr, moment_dtype=moments), torch.device("cpu"),
            HostMeter(), numel=1 << 10)
        return probe.seconds_per_byte

    first = rate(1e-3)
    assert rate(3e-4) == first
    assert rate(1e-3, moments="bf16") != first


def test_the_disk_rates_are_the_medians_of_warm_rounds(monkeypatch, tmp_path):
    """The disk probe's first write and read (a new file, cold caches) are left out and the
    median of the rounds after them is the rate: one cold round priced a Xeon's disk at
    two thirds of what it moves warm, the fastest of three warm ones at a burst."""
    times = iter([4.0, 3.0, 2.0, 1.0, 1.0, 0.5, 3.0, 2.0])  # write, read per round
    monkeypatch.setattr(machine, "timed", lambda fn: (fn(), next(times))[1])
    read, write = machine.disk_bandwidth(tmp_path, nbytes=1 << 12)
    assert (read, write) == ((1 << 12) / 1.0, (1 << 12) / 2.0)
    assert next(times, None) is None  # a warm-up round and three timed ones


def test_the_disk_rates_are_kept_per_file_system(monkeypatch, quiet, tmp_path):
    rates = iter([(1e9, 2e9), (5e9, 6e9)])
    monkeypatch.setattr(machine, "disk_bandwidth", lambda directory, nbytes: next(rates))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert machine.disk_tier_bandwidth(tmp_path / "a") == (1e9, 2e9)
    assert machine.disk_tier_bandwidth(tmp_path / "b") == (1e9, 2e9)  # the same file system
