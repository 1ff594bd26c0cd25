"""Plans' weight transfers in tests: what streams, and the price of ops with their transfers
placed among them (``plan/weight_schedule.py`` and ``plan/timeline.py``)."""
from tierflow.plan.costs import ChainCosts
from tierflow.plan.streaming import TRANSFER_RESOURCES, streamed_costs
from tierflow.plan.timeline import timeline
from tierflow.plan.weight_schedule import StreamedWeights, schedule_weights


def streaming(costs: ChainCosts, stages, depth: int, home: str = "disk",
              **options) -> StreamedWeights:
    """The ``stages`` of ``costs`` streamed from ``home``, read ``depth`` stages ahead."""
    read, write = TRANSFER_RESOURCES[home]
    return StreamedWeights(tuple((i, costs.stages[i].weight_bytes, costs.stages[i].param_bytes)
                                 for i in sorted(stages)), home, "ram", read, write, depth,
                           **options)


def step_seconds(costs: ChainCosts, ops, stages, depth: int, read_bytes_per_s: float,
                 write_bytes_per_s: float | None = None, **options) -> float:
    """One repetition of ``ops`` in the steady state, ``stages`` streamed from disk at the
    given rates, read ``depth`` stages ahead."""
    moved = streamed_costs(costs, set(stages), home="disk", read_bytes_per_s=read_bytes_per_s,
                           write_bytes_per_s=write_bytes_per_s or read_bytes_per_s,
                           depth=depth)
    schedule = schedule_weights(ops, streaming(costs, stages, depth, **options),
                                costs.length)
    return timeline(moved, (*schedule.step, *schedule.between)).time
