"""The cost side of placing things on tiers below the compute tier: what a lower tier is,
and how keeping optimizer states, streamed weights, tapes or deferred updates there changes a
chain's costs (the planner's only input) and the bytes each lower tier must hold.

``tiers.place`` builds one ``Candidate`` per placement from these and plans each.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import FitConfig
from .exec import tapes as tape_offload
from .exec.disk import DiskStore
from .exec.host_store import HostStore
from .plan.costs import ChainCosts
from .plan.tape_offload import offloaded_tape_costs
from .units import format_bytes


@dataclass(frozen=True)
class LowerTier:
    """A tier below the compute tier: its store, its measured bandwidth each way, its budget
    (None: as large as its free space)."""

    name: str  # "ram" or "disk"
    store: DiskStore | HostStore
    bandwidth: float  # bytes per second
    budget: int | None = None


@dataclass(frozen=True)
class UpdatePass:
    """The update pass after the backward when updates are deferred (gradient accumulation,
    clipping): predicted seconds and compute-tier peak, static bytes included."""

    seconds: float
    peak: int


@dataclass(frozen=True)
class Candidate:
    costs: ChainCosts
    states: LowerTier | None
    weights: LowerTier | None
    streamed: frozenset[int]
    notes: tuple[str, ...]
    tapes: LowerTier | None = None
    tape_stages: frozenset[int] = frozenset()


def with_offloaded_tapes(candidates: list[Candidate], tier: LowerTier,
                          config: FitConfig) -> list[Candidate]:
    """Each candidate also with the tapes of 1 MiB and more on ``tier`` (only those with
    ``offload_tapes='all'``)."""
    out = [] if config.offload_tapes == "all" else list(candidates)
    for c in candidates:
        stages = frozenset(i for i, s in enumerate(c.costs.stages)
                           if s.tape >= tape_offload.MIN_BYTES)
        if not stages:
            continue
        costs = offloaded_tape_costs(c.costs, set(stages), read_bytes_per_s=tier.bandwidth,
                                     write_bytes_per_s=tier.bandwidth)
        costs = replace(costs, extra={**costs.extra, "tapes tier": tier.name})
        total = format_bytes(costs.extra["offloaded tape bytes"])
        why = (f"the tapes of {len(stages)} stages ({total} in all) go to {where(tier)} as "
               f"the forward saves them and come back one backward ahead, instead of being "
               f"recomputed")
        out.append(replace(c, costs=costs, notes=c.notes + (why,), tapes=tier,
                           tape_stages=stages))
    return out


def where(home: LowerTier) -> str:
    if isinstance(home.store, DiskStore):
        return f"the disk tier ({home.store.directory})"
    return "host RAM (the tier below the simulated GPU)"


def states_below(resident: ChainCosts, base: ChainCosts, stages: list, state_of: list[int],
                  home: LowerTier) -> ChainCosts:
    """``resident`` with the optimizer states on a lower tier: each stage's states are read
    during its backward and written back after its update (only the part of that I/O that
    outlasts the backward costs time); the next stage's and the last one's are in flight."""
    moved = []
    for i, stage in enumerate(stages):
        io = 2 * state_of[i] / home.bandwidth
        moved.append(replace(stage, update_transient=stage.update_transient + state_of[i],
                             update_time=stage.update_time + max(0.0, io - stage.bwd_time)))
    return replace(resident, stages=tuple(moved),
                   static_bytes=base.static_bytes + 2 * max(state_of, default=0),
                   extra={**base.extra, f"optimizer states on {home.name}": sum(state_of)})


def lower_bytes(candidate: Candidate, base: ChainCosts, state_of: list[int],
                 lower: LowerTier, deferred: bool) -> int:
    """Bytes a placement keeps on ``lower``: states, streamed weights, stashed gradients."""
    held = sum(state_of) if candidate.states is lower else 0
    if candidate.weights is lower:
        weights = sum(base.stages[i].param_bytes for i in candidate.streamed)
        held += weights * (2 if deferred else 1)  # deferred: the gradients wait there too
    if candidate.tapes is lower:
        held += sum(base.stages[i].tape for i in candidate.tape_stages)
    return held


def deferred_costs(candidate: Candidate, base: ChainCosts, state_of: list[int],
              seconds_per_byte: float, depth: int) -> tuple[ChainCosts, UpdatePass]:
    """A candidate's costs when updates are deferred: the plan's Update(i) only hands a
    streamed stage's gradients to the lower tier (written behind its backward); resident
    stages' gradients stay for the whole step; the optimizer work moves to the update pass."""
    states, weights = candidate.states, candidate.weights
    stages, persistent, work, seconds = [], 0, 0, 0.0
    for i, s in enumerate(candidate.costs.stages):
        params = base.stages[i].param_bytes
        grads = params + (base.shared_grad_bytes if i == 0 else 0)
        io = 2 * state_of[i] / states.bandwidth if states else 0.0  # states in and out
        if i in candidate.streamed:
            stages.append(replace(s, update_time=max(0.0, grads / weights.bandwidth - s.bwd_time),
                                  update_transient=0))
            io += (3 * params + grads) / weights.bandwidth  # weights in and out, grads in
            work = max(work, params + grads + (state_of[i] if states else 0))
        else:
            stages.append(replace(s, update_time=0.0, update_transient=0))
            persistent += grads
            work = max(work, state_of[i] if states else 0)
        seconds += max(seconds_per_byte * params, io)
    costs = replace(candidate.costs, stages=tuple(stages),
                    static_bytes=candidate.costs.static_bytes + persistent)
    # the stage updating (its in-backward update transient: states, weights, temporaries),
    # `depth` stages read ahead and one written back behind
    peak = costs.static_bytes + (depth + 1) * work + max(
        (s.update_transient for s in candidate.costs.stages), default=0)
    return costs, UpdatePass(seconds, peak)
