"""The cost side of placing things on tiers below the compute tier: what a lower tier is,
and how keeping optimizer states, streamed weights, tapes or deferred updates there changes a
chain's costs (the planner's only input) and the bytes each lower tier must hold.

Pure data. ``tier_candidates`` builds one ``Candidate`` per placement from these, and
``tier_search.TierSearch`` plans each.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.config import FitConfig
from ..core.units import format_bytes
from .boundary_stash import stashable_boundaries, stashed_boundary_costs
from .costs import ChainCosts, StageCost
from .selective import selectable, selective_costs
from .streaming import TRANSFER_RESOURCES
from .tape_offload import activation_tape, offloaded_tape_costs


@dataclass(frozen=True)
class LowerTier:
    """A tier below the compute tier: its bandwidth each way (measured, or a hardware
    profile's: a disk reads and writes at different rates, a GPU's link copies down and up at
    about one), its budget (None: as large as its free space), where it is in words, and the
    bytes of it that no plan can use: ``reserve``, held whatever the placement (host RAM
    below a GPU holds the GPU runtime's own host memory), and the unused end of the
    page-locked heap the copies are carved from (``exec/pinned.py``), at most ``heap_slack``
    and at most the copies' own bytes (each segment is at most as large as the ones before
    it, or as the tensor that asked for it). A placement's bytes there are counted with both
    (``held_bytes``)."""

    name: str  # "ram" or "disk"
    read_bytes_per_s: float  # up into the compute tier
    write_bytes_per_s: float  # down from it
    budget: int | None = None
    about: str = ""  # e.g. "the disk tier (/scratch)"
    reserve: int = 0
    heap_slack: int = 0

    def held_bytes(self, placed: int) -> int:
        """What the tier holds when a placement keeps ``placed`` bytes of copies there."""
        return self.reserve + placed + min(self.heap_slack, placed)


@dataclass(frozen=True)
class UpdatePass:
    """The update pass after the backward when updates are deferred (gradient accumulation,
    clipping): predicted seconds and compute-tier peak, static bytes included."""

    seconds: float
    peak: int


def with_update_pass(peak: int, update_pass: UpdatePass | None) -> int:
    """The compute tier's bytes at a step's peak: a plan's ``peak``, or its update pass's."""
    return max(peak, update_pass.peak if update_pass is not None else 0)


@dataclass(frozen=True)
class Candidate:
    costs: ChainCosts
    states: LowerTier | None
    weights: LowerTier | None
    streamed: frozenset[int]
    notes: tuple[str, ...]
    depth: int  # stages whose weights, states and tapes are read ahead (0: on demand)
    tapes: LowerTier | None = None
    tape_stages: frozenset[int] = frozenset()
    boundaries: LowerTier | None = None  # where stashed checkpoints wait
    host_stages: frozenset[int] = frozenset()  # stages the optimizer steps in host RAM
    host: LowerTier | None = None  # that host RAM (the states' tier, or the RAM above it);
    # what those updates hold there is costs.extra["host step bytes"]
    # stages whose states stay on the compute tier beside their resident weights although
    # ``states`` names a lower tier: the fewest that make that tier hold the rest
    states_kept: frozenset[int] = frozenset()
    # the candidate whose tapes of ``tape_stages`` this one offloads (None: it offloads none),
    # for the tier search's plans that offload fewer (tier_search._fewer_tapes_below)
    before_offload: Candidate | None = None

    def states_below(self, state_of: list[int]) -> list[int]:
        """Per stage, the bytes of its optimizer states on the states' lower tier (0 for a
        stage whose states are kept on the compute tier)."""
        return [0 if i in self.states_kept else n for i, n in enumerate(state_of)]

    @property
    def tiers(self) -> tuple[LowerTier, ...]:
        """The lower tiers this placement keeps something on (a tier may appear twice)."""
        return tuple(t for t in (self.states, self.weights, self.tapes, self.boundaries,
                                 self.host) if t)


def with_offloaded_tapes(candidates: list[Candidate], tier: LowerTier, config: FitConfig,
                         min_bytes: int) -> list[Candidate]:
    """Each candidate also with the tapes of ``min_bytes`` and more on ``tier`` (only those
    with ``offload_tapes='all'``)."""
    out = [] if config.offload_tapes == "all" else list(candidates)
    for c in candidates:
        stages = frozenset(i for i in range(c.costs.length) if i not in c.costs.selective
                           and activation_tape(c.costs, i, c.streamed) >= min_bytes)
        if stages:
            out.append(offload_tapes(c, stages, tier))
    return out


def offload_tapes(c: Candidate, stages: frozenset[int], tier: LowerTier) -> Candidate:
    """``c`` with the tapes of ``stages`` on ``tier``: written as the forward saves them and
    read back for their backward (one backward ahead when ``c`` reads ahead)."""
    costs = offloaded_tape_costs(c.costs, set(stages), home=tier.name,
                                 read_bytes_per_s=tier.read_bytes_per_s,
                                 write_bytes_per_s=tier.write_bytes_per_s,
                                 read_ahead=c.depth > 0, streamed=c.streamed)
    costs = replace(costs, extra={**costs.extra, "tapes tier": tier.name})
    total = format_bytes(costs.extra["offloaded tape bytes"])
    back = "one backward ahead" if c.depth else "when their backward needs them"
    why = (f"the tapes of {len(stages)} stages ({total} in all) go to {tier.about} as "
           f"the forward saves them and come back {back}, instead of being recomputed")
    return replace(c, costs=costs, notes=c.notes + (why,), tapes=tier, tape_stages=stages,
                   before_offload=c)


def with_selective(candidates: list[Candidate], config: FitConfig) -> list[Candidate]:
    """Each candidate also with every stage that has a selective variant run selectively
    (only those with ``selective='all'``; a candidate without such a stage stays as it is)."""
    out = [] if config.selective == "all" else list(candidates)
    for c in candidates:
        stages = selectable(c.costs)
        if not stages:
            if config.selective == "all":
                out.append(c)
            continue
        costs = selective_costs(c.costs, stages)
        why = (f"{len(stages)} stages run their taped forwards selectively: they keep their "
               f"matmul and attention outputs and recompute the rest in their backward "
               f"({format_bytes(costs.extra['selective tape savings'])} less tape in all, "
               f"{sum(c.costs.stages[i].selective.recompute_time for i in stages):.2f} s "
               "more backward)")
        out.append(replace(c, costs=costs, notes=c.notes + (why,)))
    return out


def with_stashed_boundaries(candidates: list[Candidate], tier: LowerTier, config: FitConfig,
                            min_bytes: int) -> list[Candidate]:
    """Each candidate also with its checkpoints stashable on ``tier`` (``stash_boundaries=
    'all'``: instead of it, wherever the candidate has a boundary worth stashing)."""
    out = [] if config.stash_boundaries == "all" else list(candidates)
    for c in candidates:
        stashing = stash_boundaries(c, tier, min_bytes)
        if stashing is not None:
            out.append(stashing)
        elif config.stash_boundaries == "all":
            out.append(c)
    return out


def stash_boundaries(c: Candidate, tier: LowerTier, min_bytes: int) -> Candidate | None:
    """``c`` with its checkpoints of ``min_bytes`` and more stashable on ``tier`` (None: it
    has none worth stashing). A stashed checkpoint is read one backward ahead whatever the
    candidate's prefetch depth: it is a single boundary (a few MiB), counted in flight."""
    boundaries = stashable_boundaries(c.costs, read_bytes_per_s=tier.read_bytes_per_s,
                                      write_bytes_per_s=tier.write_bytes_per_s,
                                      min_bytes=min_bytes)
    if not boundaries:
        return None
    costs = stashed_boundary_costs(c.costs, boundaries, home=tier.name,
                                   read_bytes_per_s=tier.read_bytes_per_s,
                                   write_bytes_per_s=tier.write_bytes_per_s)
    costs = replace(costs, extra={**costs.extra, "boundaries tier": tier.name})
    why = (f"the checkpoints a plan recomputes from may wait in {tier.about} until "
           f"their recomputation ({len(boundaries)} boundaries, "
           f"{format_bytes(costs.extra['stashable boundary bytes'])} at most), read back "
           "one backward ahead")
    return replace(c, costs=costs, notes=c.notes + (why,), boundaries=tier)


def states_below(resident: ChainCosts, base: ChainCosts, stages: Sequence[StageCost],
                 state_of: list[int], home: LowerTier, read_ahead: bool = True,
                 kept: frozenset[int] = frozenset()) -> ChainCosts:
    """``resident`` with the optimizer states on a lower tier: each stage's states are in
    memory while it updates, and two stages' besides are in flight (the next one's read ahead
    and the last one's written back). Without ``read_ahead`` one stage's states are in
    memory at a time: a read waits for the write before it and fills the buffer that write
    frees (``Load.after_store``), so the one buffer is all they take. Their reads and writes
    are the plan's ops (``plan/state_schedule.py``), priced at ``home``'s bandwidths; one
    buffer is free between steps (``plan/buffer_windows.py``). The ``kept`` stages' states
    stay on the compute tier throughout (static bytes)."""
    below = [0 if i in kept else n for i, n in enumerate(state_of)]
    updating = below if read_ahead else [0] * len(below)  # beside the buffers in flight
    moved = [replace(stage, update_transient=stage.update_transient + updating[i])
             for i, stage in enumerate(stages)]
    read, write = TRANSFER_RESOURCES[home.name]
    static = base.static_bytes + states_in_flight(below, read_ahead) + \
        sum(state_of[i] for i in kept)
    return replace(resident, stages=tuple(moved), static_bytes=static,
                   state_buffer_bytes=max(below, default=0),
                   bandwidths={**resident.bandwidths, read: home.read_bytes_per_s,
                               write: home.write_bytes_per_s},
                   extra={**base.extra, f"optimizer states on {home.name}": sum(below)})


def states_in_flight(state_of: list[int], read_ahead: bool) -> int:
    """Compute-tier bytes of the states read ahead of, or written back after, an update
    there: the next stage's and the last one's (without read-ahead, the one buffer that
    each stage's states take in turn)."""
    return (2 if read_ahead else 1) * max(state_of, default=0)


def updated_on_host(candidate: Candidate, base: ChainCosts, state_of: list[int],
                    host: frozenset[int], link: LowerTier, host_seconds_per_byte: float,
                    weights_disk: LowerTier | None = None,
                    beside_backward: bool = True) -> ChainCosts:
    """``candidate``'s costs (its states on ``candidate.states``, the host RAM below a GPU or
    the disk below that RAM) with the ``host`` stages' updates run in host RAM instead: their
    gradients go down the ``link`` (the host RAM tier), the host optimizer steps their
    states and host copies of their weights, and the new weights come up: a streamed
    stage's with its next fetch, a resident stage's right after the step. States on disk
    are read into host RAM for the step and written back after it: read while the step
    before runs (when the candidate reads ahead, ``depth`` > 0), or by the step itself.
    Weights streamed from ``weights_disk`` (None: from host RAM) are read for the step the
    same way, and written back by the host thread after it. A streamed stage stepped there
    is read for its next forward (the plan's Loads say when).

    A stage's gradients go down by the plan's Store of them (``plan/gradient_schedule.py``,
    on the link's "copy down", priced at its bandwidth), its ``host_update_time`` is the
    host step, which the plan's ``Update(i, "host optimizer")`` runs on that thread after
    that Store (``plan/timeline.py``): beside the backward of stage i - 1, the compute tier
    waiting at stage i - 1's hand-over for what it outlasted of that backward, and at the
    end of the backward for the lowest one's. Not ``beside_backward`` (a simulated GPU: the
    host thread steps on the cores that compute), the compute tier waits for all of it: the
    step is in ``update_time``. With updates deferred, the update pass runs those Updates
    on these costs (``deferred_costs``, ``tier_search``)."""
    costs, streamed, home = candidate.costs, candidate.streamed, candidate.states
    read_ahead = candidate.depth > 0
    stages = list(costs.stages)
    for i in host:
        params = base.stages[i].param_bytes
        down = params / link.write_bytes_per_s  # the gradients, as large as the weights
        work = host_seconds_per_byte * params + (0.0 if i in streamed else down)  # + up
        weights = params if weights_disk is not None and i in streamed else 0
        work = _with_disk_io(work, state_of[i] if home.name == "disk" else 0, weights,
                             home if home.name == "disk" else weights_disk, read_ahead)
        # a streamed stage's weights stay until the update (the gradients are counted)
        stages[i] = replace(stages[i], update_time=0.0 if beside_backward else work,
                            host_update_time=work if beside_backward else 0.0,
                            update_transient=params if i in streamed else 0)
    up_there = [n for j, n in enumerate(state_of) if j not in host]
    static = costs.static_bytes - states_in_flight(state_of, read_ahead) + \
        states_in_flight(up_there, read_ahead)
    down_resource = TRANSFER_RESOURCES[link.name][1]  # the plan's Stores of the gradients
    return replace(costs, stages=tuple(stages), static_bytes=static,
                   state_buffer_bytes=max(up_there, default=0),
                   bandwidths={**costs.bandwidths, down_resource: link.write_bytes_per_s},
                   extra={**costs.extra, "updated on the host": sorted(host)})


def host_states_in_flight(state_of: list[int], host: frozenset[int], home: LowerTier,
                          read_ahead: bool) -> int:
    """Host RAM bytes of the states of the ``host`` stages when they live on disk (``home``):
    the stage stepping, the last one's being written back and, reading ahead, the next
    one's being read (none when they live in host RAM, counted there whole)."""
    if home.name != "disk":
        return 0
    return (3 if read_ahead else 2) * max(state_of[i] for i in host)


def _with_disk_io(work: float, states: int, weights: int, disk: LowerTier | None,
                  read_ahead: bool) -> float:
    """Seconds of a host step of ``work`` seconds whose ``states`` and ``weights`` bytes (0:
    not on disk) live on ``disk``: read before the step, written back after it. Reading
    ahead, I/O threads read both and write the states beside the steps of neighbouring
    stages, and the host thread writes the weights after its step: the slower of the host
    thread and the disk paces the steps. Without, the host thread waits for the reads."""
    if disk is None or not (states or weights):
        return work
    reads = (states + weights) / disk.read_bytes_per_s
    writes = (states + weights) / disk.write_bytes_per_s
    weights_written = weights / disk.write_bytes_per_s
    if read_ahead:
        return max(work + weights_written, reads + writes)
    return work + reads + weights_written


def lower_bytes(candidate: Candidate, base: ChainCosts, state_of: list[int],
                 lower: LowerTier, deferred: bool) -> int:
    """Bytes a placement keeps on ``lower``: states, what their host updates hold, streamed
    weights, stashed gradients."""
    held = sum(candidate.states_below(state_of)) if candidate.states is lower else 0
    if candidate.host is lower:
        held += candidate.costs.extra["host step bytes"]
    if candidate.weights is lower:
        held += sum(base.stages[i].weight_bytes for i in candidate.streamed)
        if deferred:  # the gradients wait there too
            held += sum(base.stages[i].param_bytes for i in candidate.streamed)
    if candidate.tapes is lower:
        held += sum(base.stages[i].tape for i in candidate.tape_stages)
    if candidate.boundaries is lower:
        held += candidate.costs.extra["stashable boundary bytes"]
    return held


def deferred_costs(candidate: Candidate, base: ChainCosts, state_of: list[int], *,
                   largest: Sequence[int] = (),
                   accumulates: bool = False) -> tuple[ChainCosts, int]:
    """A candidate's costs when updates are deferred, and the compute tier's peak of its
    update pass (static bytes included): the plan's Update(i) only says that a stage's
    gradients are complete (a streamed stage's go to the lower tier by the plan's Store of
    them, written behind the next backward, if any: one stage's at a time, static bytes
    here); resident stages' gradients stay for the whole step; the optimizer work moves to
    the update pass, whose time is its ops' on the candidate's own costs (``UpdatePass``,
    priced by ``tier_search``). ``accumulates`` (over micro-batches): each backward adds its
    gradients to ones it reads back (a streamed stage's) or keeps, so a stage's backward
    also holds a fresh gradient of its ``largest`` parameter. A stage stepped in host RAM
    (``candidate.host_stages``) adds nothing to the pass's peak on the compute tier."""
    states, state_of = candidate.states, candidate.states_below(state_of)
    stages, persistent, in_flight = [], 0, 0
    own: dict[int, int] = {}  # stage -> its bytes on the compute tier while it updates there
    work: dict[int, int] = {}  # stage -> its bytes in flight while a neighbour updates
    for i, s in enumerate(candidate.costs.stages):
        if accumulates and largest:
            s = replace(s, bwd_transient=s.bwd_transient + largest[i])
        params = base.stages[i].param_bytes
        grads = params + (base.shared_grad_bytes if i == 0 else 0)
        stages.append(replace(s, update_time=0.0, update_transient=0))
        if i in candidate.streamed:
            if i > 0:  # being written behind the next backward (the first stage's has none)
                in_flight = max(in_flight, grads)
            if i in candidate.host_stages:
                continue
            work[i] = params + grads + (state_of[i] if states else 0)
            own[i] = s.update_transient + grads  # its gradients come back from the stash
        else:
            persistent += grads
            if i in candidate.host_stages:
                continue
            work[i] = state_of[i] if states else 0
            own[i] = s.update_transient
    costs = replace(candidate.costs, stages=tuple(stages),
                    static_bytes=candidate.costs.static_bytes + persistent + in_flight)
    # at each stage of the pass (last first): the stage updating (its in-backward update
    # transient: states, weights, temporaries; a streamed stage's gradients), the `depth`
    # stages after it read ahead and the one before it written back behind. The largest
    # stages of a language model (embedding, head) are the pass's ends, never neighbours.
    order = sorted(own, reverse=True)
    peak = costs.static_bytes + max(
        (own[u] + (work[order[p - 1]] if p else 0)
         + sum(work[v] for v in order[p + 1:p + 1 + candidate.depth])
         for p, u in enumerate(order)), default=0)
    return costs, peak
