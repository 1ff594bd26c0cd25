"""How many rounds the profiler times a stage in, and which of them make its time: at least
``repeats`` after a warm-up, then more until they took ``Measuring.seconds``, at most
MAX_TIMED_ROUNDS; the stage's times are the medians of the timed rounds, which never run
beside the host meter's RSS sampler."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch import nn

from tierflow.chain import to_chain
from tierflow.exec.context import AutocastMode
from tierflow.exec import memory
from tierflow.exec.memory import HostMeter
from tierflow.profile import profiler


def _round(fwd: float, bwd: float, tape: int = 0) -> profiler._Measured:
    """A round's measure: its times and tape, nothing else held."""
    return profiler._Measured(fwd_time=fwd, bwd_time=bwd, output_bytes=0, tape=tape,
                              output_in_tape=False, fwd_transient=0, fwd_transient_nograd=0,
                              bwd_transient=0, largest_block=0)


def _profile_linear(monkeypatch, measuring: profiler.Measuring, fake_round) -> profiler.StageCost:
    """The cost of one linear stage profiled with ``measuring``, its rounds ``fake_round``."""
    monkeypatch.setattr(profiler, "measure_round", fake_round)
    monkeypatch.setattr(profiler, "_CACHE", {})
    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    costs, _ = profiler.profile_chain(to_chain(model, x), x, {}, AutocastMode.capture("cpu"),
                                      measuring)
    return costs[0]


def _profile(monkeypatch, measuring: profiler.Measuring, times: list[tuple[float, float]],
             samplers: list[bool] | None = None) -> tuple[profiler.StageCost, int]:
    """The first stage's cost when its rounds take ``times`` (forward, backward seconds), one
    after another, and how many rounds ran; ``samplers`` gets, round by round, whether the
    round's meter sampled the RSS."""
    calls = itertools.count()
    rounds = iter(times)

    def fake_round(run, meter, ledger, selective=False):
        next(calls)
        if samplers is not None:
            samplers.append(isinstance(meter, HostMeter) and meter.interval is not None)
        return _round(*next(rounds))

    cost = _profile_linear(monkeypatch, measuring, fake_round)
    return cost, next(calls)


def test_without_seconds_the_repeats_after_a_warm_up_are_timed(monkeypatch) -> None:
    measuring = profiler.Measuring(HostMeter(interval=None), repeats=2, selective=False)
    cost, rounds = _profile(monkeypatch, measuring, [(9.0, 9.0), (0.1, 0.2), (0.3, 0.4)])
    assert rounds == 3
    assert cost.fwd_time == pytest.approx(0.2)  # the warm-up's 9 s left out
    assert cost.bwd_time == pytest.approx(0.3)


def test_more_rounds_are_timed_until_they_took_the_seconds(monkeypatch) -> None:
    measuring = profiler.Measuring(HostMeter(interval=None), repeats=2, seconds=1.0, selective=False)
    # warm-up, then rounds of 0.3 s: the fourth brings the timed ones to 1.2 s
    times = [(9.0, 9.0), (0.1, 0.2), (0.1, 0.2), (0.2, 0.1), (0.2, 0.1), (7.0, 7.0)]
    cost, rounds = _profile(monkeypatch, measuring, times)
    assert rounds == 5
    assert cost.fwd_time == pytest.approx(0.15)  # median of 0.1, 0.1, 0.2, 0.2
    assert cost.bwd_time == pytest.approx(0.15)


def test_a_fast_stage_is_timed_in_at_most_max_timed_rounds(monkeypatch) -> None:
    measuring = profiler.Measuring(HostMeter(interval=None), repeats=2, seconds=100.0, selective=False)
    cost, rounds = _profile(monkeypatch, measuring, [(0.001, 0.002)] * 100)
    assert rounds == 1 + profiler.MAX_TIMED_ROUNDS


def test_under_a_timing_context_the_extra_rounds_run_inside_it(monkeypatch) -> None:
    """Memory rounds first (warm-up and repeats), then the timing context's own warm-up and
    rounds, then more until the seconds: all of the timed ones inside the context."""
    inside = []

    @contextlib.contextmanager
    def timing():
        inside.append(True)
        yield
        inside.append(False)

    measuring = profiler.Measuring(HostMeter(), repeats=2, seconds=0.9, timing=timing,
                                   selective=False)
    memory = [(5.0, 5.0)] * 3
    timed = [(9.0, 9.0), (0.1, 0.2), (0.1, 0.2), (0.1, 0.2), (8.0, 8.0)]
    samplers = []
    cost, rounds = _profile(monkeypatch, measuring, memory + timed, samplers)
    assert rounds == 3 + 4
    assert inside == [True, False]
    assert cost.fwd_time == pytest.approx(0.1)
    assert samplers == [True] * 3 + [False] * 4


def test_rounds_measured_beside_the_rss_sampler_are_not_timed(monkeypatch) -> None:
    """Without a timing context, a sampling host meter's memory rounds (warm-up and repeats)
    are followed by as many timed rounds of their own, without the sampler."""
    measuring = profiler.Measuring(HostMeter(), repeats=2, selective=False)
    memory = [(5.0, 5.0)] * 3
    timed = [(0.1, 0.2), (0.3, 0.4)]
    samplers = []
    cost, rounds = _profile(monkeypatch, measuring, memory + timed, samplers)
    assert rounds == 5
    assert samplers == [True] * 3 + [False] * 2
    assert (cost.fwd_time, cost.bwd_time) == (pytest.approx(0.2), pytest.approx(0.3))


def test_a_meter_without_a_sampler_starts_no_thread_and_keeps_the_rss_at_its_reset(
        monkeypatch) -> None:
    readings = iter([900, 500, 500])  # the RSS at reset_peak, then lower
    monkeypatch.setattr(memory, "rss_bytes", lambda: next(readings))
    meter = HostMeter(interval=None)
    meter.reset_peak()
    assert meter.current() == 500
    assert meter.peak() == 900
    assert meter._thread is None


@pytest.mark.parametrize("selective_tape, selective_rounds", [
    (0, 1),  # keeps nothing: the whole stage would be recomputed
    (100, 1),  # keeps all the whole tape keeps
    (40, 3),  # keeps less: measured as any variant, and kept
])
def test_a_selective_variant_that_keeps_nothing_less_stops_after_its_warm_up(
        monkeypatch, selective_tape: int, selective_rounds: int) -> None:
    """The variant's warm-up round tells whether it qualifies (something kept, less than
    the whole tape); one that does not runs no more rounds and is not part of the cost."""
    ran = []

    def fake_round(run, meter, ledger, selective=False):
        ran.append(selective)
        return _round(0.1, 0.2, selective_tape if selective else 100)

    measuring = profiler.Measuring(HostMeter(interval=None), repeats=2, selective=True)
    kept = _profile_linear(monkeypatch, measuring, fake_round).selective
    assert ran.count(False) == 3 and ran.count(True) == selective_rounds
    assert (kept is not None and kept.tape == 40) if selective_rounds > 1 else kept is None
