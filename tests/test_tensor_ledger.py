"""The tensor ledger counts storage bytes op by op; the profiler's host transients do not
depend on the RSS sampler catching a peak, and a stage's largest tensor reaches make_room."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from tierflow.chain import to_chain
from tierflow.exec.context import AutocastMode
from tierflow.exec.memory import HostMeter, rss_bytes
from tierflow.profile import profiler
from tierflow.profile.tensor_ledger import TensorLedger

MIB = 1 << 20


def test_new_storages_count_until_freed_and_views_do_not() -> None:
    x = torch.ones(MIB // 4)  # 1 MiB of fp32, made before the ledger
    with TensorLedger() as ledger:
        y = x * 2
        assert ledger.net == MIB
        view = y.view(-1, 4).t()  # shares y's storage
        assert ledger.net == MIB
        del y, view
        assert ledger.net == 0
        z = x + 1
        w = z * 3
        assert ledger.net == 2 * MIB
        del z, w
    assert ledger.peak == 2 * MIB
    assert ledger.largest == MIB


def test_storages_met_as_inputs_take_their_bytes_off_when_freed() -> None:
    saved = torch.ones(MIB // 4)  # like a tensor saved for backward, freed during it
    with TensorLedger() as ledger:
        out = saved.sum()
        ledger.restart()
        del saved
        assert ledger.net == -MIB
        assert ledger.peak == 0
    del out


class _Temporary(nn.Module):
    """Makes an 8 MiB temporary between a 64 KiB input and a 64 KiB output."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 8192)
        self.down = nn.Linear(8192, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (256, 64)
        return self.down(torch.relu(self.up(x)))  # (256, 8192) in between


class _BlindMeter(HostMeter):
    """An RSS meter whose sampler never catches anything: its peak is the RSS at the reset."""

    def reset_peak(self) -> None:
        self._peak = rss_bytes()

    def peak(self) -> int:
        return self._peak


def _transients(meter: HostMeter, timing) -> profiler.StageCost:
    profiler._CACHE.clear()
    model = nn.Sequential(_Temporary(), nn.Linear(64, 64))
    x = torch.randn(256, 64)
    chain = to_chain(model, x)
    costs, _ = profiler.profile_chain(chain, x, {}, AutocastMode.capture("cpu"),
                                      profiler.Measuring(meter, repeats=1, timing=timing))
    return costs[0]


def test_a_peak_the_sampler_misses_is_still_measured_when_memory_is_at_stake() -> None:
    hidden = 256 * 8192 * 4  # the (256, 8192) fp32 temporary: 8 MiB
    try:
        budgeted = _transients(_BlindMeter(), timing=contextlib.nullcontext)
        unbudgeted = _transients(_BlindMeter(), timing=None)
    finally:
        profiler._CACHE.clear()
    # up's output and its relu live at once without grad (the transient is counted less the
    # stage's output); in the backward the gradients of both are made
    assert budgeted.fwd_transient_nograd + budgeted.output_bytes >= 2 * hidden
    assert budgeted.bwd_transient >= hidden
    # without a RAM budget the rounds are also timed, and only the meter is read
    assert unbudgeted.fwd_transient_nograd == 0


def test_a_fitted_module_counts_a_stage_largest_tensor_as_a_block_the_cache_cannot_serve(
        monkeypatch) -> None:
    """Under a RAM budget the profile records the largest tensor each stage allocates (the
    8 MiB temporary), and before that stage's operations ``make_room`` is told its gradient's
    block and that tensor: malloc's scattered free pieces serve neither."""
    import tierflow
    from tierflow.exec.memory import HostRoom

    profiler._CACHE.clear()
    told: list[int] = []
    real = HostRoom.make_room

    def make_room(room: HostRoom, nbytes: int, fresh: bool = False, largest: int = 0) -> None:
        told.append(largest)
        real(room, nbytes, fresh, largest)

    monkeypatch.setattr(HostRoom, "make_room", make_room)
    model = nn.Sequential(_Temporary(), nn.Linear(64, 64))
    try:
        module = tierflow.fit(model, torch.randn(256, 64), ram="1GiB")
    finally:
        profiler._CACHE.clear()
    hidden, gradient = 256 * 8192 * 4, 8192 * 64 * 4  # the temporary; up's weight gradient
    assert module.plan.costs.stages[0].largest_block == hidden
    module(torch.randn(256, 64)).sum().backward()
    assert max(told) == hidden + gradient
