"""A placement that offloads tapes offloads every stage's worth it; where its budget has room
left, the tier search also plans it keeping the last stages' tapes in memory, as many as the
room holds, and that plan competes with the others (it moves fewer bytes on a tie)."""
from tierflow import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Store
from tierflow.plan.tape_schedule import TAPE
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import place_on_tiers

MiB = 1 << 20
# recomputing a stage costs its 0.2 s forward; writing or reading its tape 0.07 s beside it
STAGE = StageCost("layer", fwd_time=0.2, bwd_time=0.4, param_bytes=8 * MiB,
                  output_bytes=MiB, tape=64 * MiB)
STAGES = 8
CONFIG = FitConfig(optimizer_states="compute", stream="never", selective="never",
                   offload_tapes="auto", stash_boundaries="never")


def _placed(budget_mib: int, config: FitConfig = CONFIG):
    costs = ChainCosts(stages=(STAGE,) * STAGES, input_bytes=MiB,
                       static_bytes=STAGES * 8 * MiB)
    problem = TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, None),
                          largest=(8 * MiB,) * STAGES, trainable=STAGES * 8 * MiB,
                          streamable=tuple(range(STAGES)),
                          lower=(LowerTier("disk", 1e9, 1e9, None, "the disk tier"),))
    return place_on_tiers(problem, budget_mib * MiB, config, "ram")


def test_the_last_stages_tapes_stay_where_the_budget_has_room():
    """At 500 MiB every tape does not fit (keeping them all needs about 620 MiB) and
    recomputing costs a forward per stage, so the tapes go to the disk: the first stages'
    only, the last ones' kept as far as the budget holds them, at no more predicted time
    than offloading all and with fewer bytes moved."""
    placed = _placed(500)
    every = _placed(500, FitConfig(**{**CONFIG.__dict__, "offload_tapes": "all"}))
    assert _sent_down(every) == list(range(STAGES - 1))  # the last one's backward is next
    assert placed.plan.strategy == "keep-all"
    sent = _sent_down(placed)
    assert 0 < len(sent) < STAGES - 1 and sent == list(range(len(sent)))  # the first ones
    assert placed.plan.planned_peak <= 500 * MiB
    assert placed.predicted_time <= every.predicted_time
    assert placed.moved_bytes < every.moved_bytes


def test_without_room_every_tape_goes():
    """At the budget offloading every tape just fits, none can stay."""
    every = _placed(500, FitConfig(**{**CONFIG.__dict__, "offload_tapes": "all"}))
    tight = every.plan.planned_peak // MiB + 1
    assert _sent_down(_placed(tight)) == list(range(STAGES - 1))


def _sent_down(placed) -> list[int]:
    """The stages whose tapes the plan writes to the lower tier."""
    return sorted(op.stage for op in placed.plan.ops if isinstance(op, Store) and op.what == TAPE)
