"""The rotor fits a plan's planned peak, every buffer of transfers held by every op, but the
plan's predicted peak counts a buffer as free where its timeline has it free (one stage's
optimizer states outside the backward's updates, plan/buffer_windows.py). So the tier
search plans each placement with buffers again as if the budget held them, and keeps that
plan when its predicted peak still fits the budget and it is faster."""
from tierflow import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import place_on_tiers

MiB = 1 << 20
STAGE = StageCost("layer", fwd_time=0.05, bwd_time=0.1, param_bytes=64 * MiB,
                  output_bytes=MiB, tape=32 * MiB)
# AdamW states (2 bytes per weight byte) on the disk, read on demand: one 128 MiB buffer
STATES_ON_DISK = FitConfig(prefetch_depth=0, stream="never", optimizer_states="disk",
                           selective="never", offload_tapes="never")


def _placed(budget_mib: int):
    costs = ChainCosts(stages=(STAGE,) * 4, input_bytes=MiB, static_bytes=4 * 64 * MiB)
    problem = TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, None),
                          largest=(64 * MiB,) * 4, trainable=4 * 64 * MiB,
                          streamable=(0, 1, 2, 3),
                          lower=(LowerTier("disk", 1e9, 1e9, None, "the disk tier"),))
    return place_on_tiers(problem, budget_mib * MiB, STATES_ON_DISK, "ram")


def test_a_plan_keeps_what_fits_with_its_buffers_free_where_they_are():
    """At 552 MiB every tape is kept: its planned peak (582 MiB) passes the budget, its
    predicted peak (550 MiB: the states' buffer is free at the end of the forward) does not.
    At 544 MiB the room is not enough and the rotor recomputes; keeping is faster. The plan
    names the budget it was asked for and says why it holds more on paper."""
    roomy, tight = _placed(552), _placed(544)
    assert roomy.plan.strategy == "keep-all" and tight.plan.strategy == "rotor"
    assert roomy.predicted_peak <= 552 * MiB < roomy.plan.planned_peak
    assert tight.plan.planned_peak <= 544 * MiB
    assert roomy.predicted_time < tight.predicted_time
    assert roomy.plan.budget == 552 * MiB
    assert any("more were free" in note for note in roomy.plan.notes)
    assert not any("more were free" in note for note in tight.plan.notes)


def test_a_plan_without_buffers_is_planned_once():
    """States on the compute tier: no buffer, no second plan, the planned peak fits."""
    config = FitConfig(optimizer_states="compute", stream="never", selective="never",
                       offload_tapes="never")
    costs = ChainCosts(stages=(STAGE,) * 4, input_bytes=MiB, static_bytes=4 * 64 * MiB)
    problem = TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, None),
                          largest=(64 * MiB,) * 4, trainable=4 * 64 * MiB,
                          streamable=(0, 1, 2, 3), lower=())
    placed = place_on_tiers(problem, 900 * MiB, config, "ram")
    assert placed.plan.planned_peak <= 900 * MiB
    assert not any("more were free" in note for note in placed.plan.notes)
