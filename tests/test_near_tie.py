"""Placements predicted within ``NEAR_TIE`` of the fastest are a tie, won by the one that
moves the fewest bytes between tiers (``TierSearch.best``, by
``_least_moved_of_the_fastest``): W2 at 8 GiB had two placements
0.1% apart, which `tierflow plan --measure` and `tierflow train` ordered differently."""
from dataclasses import dataclass

import pytest

from tierflow import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Load, Store
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import NEAR_TIE, _least_moved_of_the_fastest, place_on_tiers

MiB = 1 << 20


@dataclass(frozen=True)
class _Placed:
    """What ``best`` reads of a placement."""

    name: str
    predicted_time: float
    moved_bytes: int


def test_a_placement_a_little_faster_that_moves_more_loses_the_tie():
    resident = _Placed("resident", 48.98, 0)
    streamed = _Placed("streamed", 48.92, 23 * 352 * MiB)
    assert _least_moved_of_the_fastest([streamed, resident]).name == "resident"


def test_a_placement_faster_by_more_than_the_tie_wins_whatever_it_moves():
    resident = _Placed("resident", 50.0, 0)
    streamed = _Placed("streamed", 50.0 / (1 + 2 * NEAR_TIE), 23 * 352 * MiB)
    assert _least_moved_of_the_fastest([resident, streamed]).name == "streamed"


def test_among_placements_that_move_as_much_the_fastest_wins():
    slow = _Placed("slow", 10.05, 5 * MiB)
    fast = _Placed("fast", 10.0, 5 * MiB)
    assert _least_moved_of_the_fastest([slow, fast]).name == "fast"


@pytest.mark.parametrize("states", ["disk", "compute"])
def test_moved_bytes_are_the_bytes_of_the_plans_loads_and_stores(states):
    stage = StageCost("layer", fwd_time=0.05, bwd_time=0.1, param_bytes=64 * MiB,
                      output_bytes=MiB, tape=4 * MiB)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=MiB, static_bytes=4 * 64 * MiB)
    disk = LowerTier("disk", 1e9, 1e9, None, "the disk tier")
    problem = TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, None),
                          largest=(64 * MiB,) * 4, trainable=4 * 64 * MiB,
                          streamable=(0, 1, 2, 3), lower=(disk,))
    config = FitConfig(planner="checkpoint-all", stream="never", optimizer_states=states)
    placed = place_on_tiers(problem, None, config, "ram")
    r = placed.plan.routines
    moves = [op for op in (*placed.plan.ops, *r.between, *r.update_pass)
             if isinstance(op, (Load, Store))]
    assert placed.moved_bytes == sum(op.nbytes for op in moves)
    assert (placed.moved_bytes > 0) == (states == "disk")
