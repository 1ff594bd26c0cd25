"""The update pass's price when updates are deferred (``plan/tier_costs.deferred_costs``):
each stage of the pass with its real neighbours, the gradients written behind a backward,
and the fresh gradient a backward holds when it accumulates. Pure data."""
import pytest

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.streaming import streamed_costs
from tierflow.plan.tier_costs import Candidate, LowerTier, deferred_costs

MIB = 1 << 20


def _all_streamed(params_mib: list[int], depth: int = 0):
    """A chain whose every stage streams its weights from a disk that also holds the AdamW
    states (2 bytes per weight byte)."""
    stages = tuple(StageCost(f"s{i}", fwd_time=0.01, bwd_time=0.02, param_bytes=p * MIB,
                             output_bytes=MIB, tape=MIB, bwd_transient=MIB)
                   for i, p in enumerate(params_mib))
    base = ChainCosts(stages=stages, input_bytes=MIB, static_bytes=sum(params_mib) * MIB)
    disk = LowerTier("disk", 1e9, 1e9, None, "the disk")
    streamed = frozenset(range(len(stages)))
    costs = streamed_costs(base, set(streamed), home="disk", read_bytes_per_s=1e9,
                           write_bytes_per_s=1e9, depth=depth)
    candidate = Candidate(costs, disk, disk, streamed, (), depth)
    return candidate, base, [2 * p * MIB for p in params_mib]


@pytest.mark.parametrize("params, depth, pass_mib", [
    ([8, 1, 1, 8], 0, 34),  # layer 2 updating (2) beside the head written back (32)
    ([1, 8, 8, 1], 0, 48),  # the two large ones next to each other: 16 + 32
    ([8, 1, 1, 8], 1, 38),  # and the next stage read ahead: 2 + 32 + 4
])
def test_each_stage_of_the_pass_is_priced_with_its_neighbours(params, depth, pass_mib):
    """A stage updating holds its weights and gradients (2x its weights; its states are in
    the in-backward transient they come with); the one before it in the pass (last first)
    is written back behind it (weights, gradients and states: 4x) and ``depth`` after it are
    read ahead. The largest stages at the ends of the chain (an embedding and a head) are
    never neighbours, so the pass needs less than twice the largest stage's bytes."""
    candidate, base, state_of = _all_streamed(params, depth)
    costs, pass_peak = deferred_costs(candidate, base, state_of)
    assert pass_peak - costs.static_bytes == pass_mib * MIB


def test_gradients_written_behind_a_backward_are_static_and_accumulation_adds_one():
    """A streamed stage's gradients leave for the disk after its backward, written behind the
    next one: the largest stage's are counted as static. Accumulating over micro-batches, a
    backward adds a fresh gradient of the stage's largest parameter to the one read back."""
    candidate, base, state_of = _all_streamed([8, 1, 1, 8])
    largest = (6 * MIB, MIB, MIB, 6 * MIB)
    once, _ = deferred_costs(candidate, base, state_of, largest=largest)
    assert once.static_bytes == candidate.costs.static_bytes + 8 * MIB
    assert [s.bwd_transient for s in once.stages] == [s.bwd_transient
                                                      for s in candidate.costs.stages]
    accumulating, _ = deferred_costs(candidate, base, state_of, largest=largest,
                                     accumulates=True)
    assert [s.bwd_transient - t.bwd_transient for s, t in
            zip(accumulating.stages, candidate.costs.stages)] == list(largest)
