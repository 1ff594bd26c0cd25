"""A lower tier moves bytes up and down at two rates (a disk reads slower than it writes:
``benchmarks/results/disk-duplex-2026-11-29.json``, 1.64 GiB/s against 2.68): the plan's
Loads from it take their bytes at its read rate and its Stores at its write rate, and a host
step whose states live on it waits for each direction at its own rate."""
from dataclasses import replace

import pytest

from tierflow import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Load, Store
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import place_on_tiers
from tierflow.plan.timeline import timeline

MiB = 1 << 20
READ, WRITE = 1e9, 4e9


def _problem(disk: LowerTier) -> TierProblem:
    """Four like stages of 64 MiB of weights with AdamW (2 bytes of state per weight byte)
    on a CPU whose disk tier is ``disk``."""
    stage = StageCost("layer", fwd_time=0.05, bwd_time=0.1, param_bytes=64 * MiB,
                      output_bytes=MiB, tape=4 * MiB)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=MiB, static_bytes=4 * 64 * MiB)
    return TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, None),
                       largest=(64 * MiB,) * 4, trainable=4 * 64 * MiB,
                       streamable=(0, 1, 2, 3), lower=(disk,))


@pytest.mark.parametrize("what", ["weights", "states"])
def test_loads_take_the_read_rate_and_stores_the_write_rate(what):
    """Optimizer states on the disk, the weights streamed from it too or not: every Load of
    the plan lasts its bytes over the disk's read rate, every Store its bytes over the write
    rate."""
    disk = LowerTier("disk", READ, WRITE, None, "the disk tier")
    config = FitConfig(planner="checkpoint-all", prefetch_depth=1,
                       stream="all" if what == "weights" else "never",
                       optimizer_states="disk")
    placed = place_on_tiers(_problem(disk), None, config, "ram")
    plan = placed.plan
    line = timeline(plan.costs, plan.ops)
    moves = [(op, span) for op, span in zip(plan.ops, _spans_by_position(plan.ops, line))
             if isinstance(op, (Load, Store)) and op.what == what and span is not None]
    assert {type(op) for op, _ in moves} == {Load, Store}
    for op, span in moves:
        rate = READ if isinstance(op, Load) else WRITE
        assert span.end - span.start == pytest.approx(op.nbytes / rate, rel=1e-9), op


def _spans_by_position(ops, line):
    """Each op's span in the timeline's measured repetition (None: it takes no time)."""
    at = {span.position: span for span in line.spans}
    return [at.get(position) for position in range(len(ops))]


def test_a_slower_read_lengthens_the_reads_alone():
    """The same placement on a disk reading at a quarter of the rate: the disk reads are
    busy four times as long, the writes as long as before, and the step (bound by the disk
    here: 64 MiB stages outlast their compute) takes longer."""
    config = FitConfig(planner="checkpoint-all", prefetch_depth=1, stream="all",
                       optimizer_states="disk")
    even = LowerTier("disk", WRITE, WRITE, None, "the disk tier")
    busy, times = {}, {}
    for name, disk in (("even", even), ("slow read", replace(even, read_bytes_per_s=READ))):
        plan = place_on_tiers(_problem(disk), None, config, "ram").plan
        line = timeline(plan.costs, plan.ops)
        busy[name] = (line.busy("disk read"), line.busy("disk write"))
        times[name] = line.time
    assert busy["slow read"][0] == pytest.approx(4 * busy["even"][0])
    assert busy["slow read"][1] == pytest.approx(busy["even"][1])
    assert times["slow read"] > times["even"]
