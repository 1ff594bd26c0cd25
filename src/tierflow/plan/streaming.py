"""Costs of a chain whose chosen stages keep their weights on a lower tier (disk) and fetch
them into the compute tier around their own operations.

Pure data. A streamed stage's weights are not static any more: they are resident while the
stage runs (a forward, a backward, the update after it) and while its tape lives, so they
join the stage's tape and its transients; ``depth`` stages fetched ahead, plus one stage
being written back after its update, are the buffers the streaming adds to the static bytes.
With ``depth`` 0 a stage is read when it is needed, and its forward costs both the read and
the compute. With ``depth`` d a stage's read starts d stages before its forward, so it has
about d stages of compute to hide behind: on a chain of like stages (the decoder layers that
dominate), d times its own; its forward costs the longer of its compute and a d-th of its
read. A stage's frozen weights (``frozen_bytes``) are read and held like the others but
never written back: they do not change. A deeper prefetch costs a buffer of the largest
streamed stage per stage of depth. The write-back of updated weights runs beside the next
backward, so only the part of it that outlasts the stage's own backward time is added. A
stage whose tape waits on a lower tier has its weights read again for its backward
(``read_again_for_backward``): the tape does not hold them. With updates inside the
backward, the first ``depth`` + 1 streamed stages are updated last and run first in the next
step: their weights stay resident in between (in the buffers above), so their forwards read
nothing (``kept_across_steps``).
"""
from __future__ import annotations

from dataclasses import replace

from .costs import ChainCosts, StageCost


def streamed_costs(costs: ChainCosts, streamed: set[int], *, read_bytes_per_s: float,
                   write_bytes_per_s: float, depth: int,
                   kept_across_steps: frozenset[int] = frozenset()) -> ChainCosts:
    """``costs`` with the weights of the ``streamed`` stages living on the lower tier;
    ``kept_across_steps``: the stages among the first ``depth`` + 1 streamed ones whose
    weights stay resident from their update to the next step's forward (updates inside the
    backward). Their forwards had they been read are in ``extra["weights kept across
    steps"]`` as {stage: seconds}, for a plan that steps them elsewhere
    (tier_costs.updated_on_host)."""
    if not streamed:
        return costs
    if depth < 0:
        raise ValueError(f"prefetch depth {depth} must be at least 0")
    stages = list(costs.stages)
    moved = 0
    for i in sorted(streamed):
        stages[i] = _streamed_stage(stages[i], read_bytes_per_s, write_bytes_per_s, depth)
        moved += stages[i].weight_bytes
    largest = max(costs.stages[i].weight_bytes for i in streamed)
    buffers = min(depth + 1, len(streamed)) * largest
    extra = {**costs.extra, "streamed stages": sorted(streamed), "streamed bytes": moved,
             "prefetch depth": depth, "stream buffers": buffers}
    kept = kept_across_steps & set(sorted(streamed)[:depth + 1])
    if kept:
        extra["weights kept across steps"] = {i: stages[i].fwd_time for i in sorted(kept)}
        for i in kept:
            stages[i] = replace(stages[i], fwd_time=costs.stages[i].fwd_time)
    return replace(costs, stages=tuple(stages),
                   static_bytes=costs.static_bytes - moved + buffers, extra=extra)


def read_again_for_backward(costs: ChainCosts, stages: set[int], *, read_bytes_per_s: float,
                            depth: int) -> ChainCosts:
    """``costs`` with the weights of the streamed ``stages`` read a second time, for their
    backward: their tapes do not hold them (the tapes wait on a lower tier), so the weights
    leave after the forward. The read is priced as the forward's is: added whole at
    ``depth`` 0, else hidden behind ``depth`` backwards of like stages."""
    moved = list(costs.stages)
    for i in stages:
        s = moved[i]
        read = s.weight_bytes / read_bytes_per_s
        moved[i] = replace(s, bwd_time=_with_read(s.bwd_time, read, depth))
    return replace(costs, stages=tuple(moved))


def _with_read(compute: float, read: float, depth: int) -> float:
    """Seconds of an operation of ``compute`` seconds whose weights take ``read`` seconds to
    read: after the read at ``depth`` 0, else behind ``depth`` like operations before it."""
    return max(compute, read / depth) if depth else compute + read


def _streamed_stage(s: StageCost, read_bps: float, write_bps: float, depth: int) -> StageCost:
    read = s.weight_bytes / read_bps
    write = s.param_bytes / write_bps  # the trainable weights, after their update
    return replace(s,
                   fwd_time=_with_read(s.fwd_time, read, depth),
                   tape=s.tape + s.weight_bytes,
                   fwd_transient_nograd=s.fwd_transient_nograd + s.weight_bytes,
                   update_transient=s.update_transient + s.weight_bytes,
                   update_time=s.update_time + max(0.0, write - s.bwd_time))
