"""The placements a training step could use when tierflow owns the optimizer, one
``Candidate`` each: the optimizer states on the compute tier or on a tier below it, the
weights of the largest stages (or all) streamed from a lower tier too, the updates of the
stages whose states live below a GPU stepped in host RAM or not, and each of those with its
tapes offloaded and its checkpoints stashable, at a given prefetch depth. What the search
is asked (``TierProblem``) is defined here too.

Pure data. ``tier_search.TierSearch`` plans every candidate and keeps the fastest that fits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.config import FitConfig
from ..core.errors import BudgetError
from ..core.units import format_bytes
from .boundary_stash import MIN_BOUNDARY_BYTES
from .choose import make_plan
from .costs import ChainCosts
from .streaming import streamed_costs
from .tape_offload import MIN_TAPE_BYTES
from .tier_costs import (
    Candidate,
    LowerTier,
    host_states_in_flight,
    states_below,
    updated_on_host,
    with_offloaded_tapes,
    with_selective,
    with_stashed_boundaries,
)

PREFETCH_DEPTHS = (0, 1, 2)  # what the planner tries when the config leaves the depth open
KEPT_WHOLE = (1, 2, 4)  # stages kept whole on the compute tier, at the deepest prefetch


@dataclass(frozen=True)
class UpdateRates:
    """What one optimizer step costs, per byte of the parameters it updates."""

    state_per_byte: float  # bytes of optimizer state kept between steps
    seconds_per_byte: float
    transient_per_byte: float  # temporaries during a step, per byte of the largest parameter
    transient_bytes: int = 0  # temporaries during a step, whatever the parameter's size
    # the optimizer's step in host RAM below a GPU (None: no such tier, or not measured)
    host_seconds_per_byte: float | None = None
    # that step runs on the cores that compute (a simulated GPU): it hides behind nothing
    host_shares_compute: bool = False


@dataclass(frozen=True)
class TierProblem:
    """Everything the placement depends on besides the budgets and the config.

    ``largest``: per stage, the bytes of its largest trainable parameter; ``trainable``:
    bytes of the trainable parameters; ``streamable``: the stages whose weights may live on
    a lower tier (those no other stage shares); ``lower``: the tiers below the compute tier,
    nearest first; ``weights_tiers``: where weights may stream from (None: any lower tier);
    ``deferred``: updates run in one pass after the backward (accumulation, clipping);
    ``accumulates``: over several micro-batches (each backward adds to gradients it reads
    back); ``host_updatable``: the stages whose parameters the optimizer may step in host
    RAM (those that own trainable parameters); ``updated``: the stages whose parameters the
    optimizer steps (those that own trainable parameters; None: those with ``param_bytes``);
    ``micro_batches``: per optimizer step, each running the plan once."""

    costs: ChainCosts
    rates: UpdateRates
    largest: tuple[int, ...]
    trainable: int
    streamable: tuple[int, ...]
    lower: tuple[LowerTier, ...]
    weights_tiers: tuple[LowerTier, ...] | None = None
    deferred: bool = False
    accumulates: bool = False
    min_tape_bytes: int = MIN_TAPE_BYTES
    min_boundary_bytes: int = MIN_BOUNDARY_BYTES
    host_updatable: tuple[int, ...] = ()
    updated: tuple[int, ...] | None = None
    micro_batches: int = 1  # per optimizer step (gradient accumulation)

    @property
    def optimizer_stages(self) -> tuple[int, ...]:
        """The stages whose parameters the optimizer steps."""
        if self.updated is not None:
            return self.updated
        return tuple(i for i, s in enumerate(self.costs.stages) if s.param_bytes)


@dataclass(frozen=True)
class _Owned:
    """The owned optimizer priced into ``TierProblem.costs``, once for every prefetch depth
    (``all_candidates``), which every placement starts from: ``resident``, the costs with
    each stage's update (its time and temporaries) and every optimizer state on the compute
    tier; ``state_of``, each stage's state bytes; ``state_bytes``, those of every trainable
    parameter."""

    resident: ChainCosts
    state_of: list[int]
    state_bytes: int


def all_candidates(problem: TierProblem, budget: int | None, config: FitConfig,
                    tier: str) -> tuple[list[Candidate], list[int]]:
    """Every placement at every prefetch depth the config allows, and each stage's optimizer
    state bytes."""
    costs, rates = problem.costs, problem.rates
    stages = [replace(s, update_time=rates.seconds_per_byte * s.param_bytes,
                      update_transient=int(rates.transient_per_byte * big)
                      + rates.transient_bytes)
              for s, big in zip(costs.stages, problem.largest)]
    state_bytes = int(rates.state_per_byte * problem.trainable)
    state_of = [int(rates.state_per_byte * (s.param_bytes + (costs.shared_grad_bytes
                                                            if i == 0 else 0)))
                for i, s in enumerate(costs.stages)]
    resident = replace(costs, stages=tuple(stages), optimizer_owned=True,
                       static_bytes=costs.static_bytes + state_bytes,
                       extra={**costs.extra, "optimizer states": state_bytes})
    owned = _Owned(resident, state_of, state_bytes)
    depths = PREFETCH_DEPTHS if config.prefetch_depth is None else (config.prefetch_depth,)
    candidates: list[Candidate] = []
    for depth in depths:
        candidates += _candidates(problem, owned, budget, config, tier, depth,
                                  kept_whole=depth == depths[-1])
    return candidates, state_of


def _candidates(problem: TierProblem, owned: _Owned, budget: int | None, config: FitConfig,
                tier: str, depth: int, kept_whole: bool = True) -> list[Candidate]:
    """The placements read ``depth`` stages ahead: the optimizer states on the compute tier
    or on each lower tier, with the weights of the largest stages (or all) streamed from a
    lower tier too, or (``kept_whole``: at the deepest prefetch only, each is a rotor plan
    more) of all but a few stages kept whole, and each of those run selectively, with its
    tapes offloaded (of the stages not selective) and its checkpoints stashable."""
    candidates: list[Candidate] = []
    base = problem.costs
    sources = problem.lower if problem.weights_tiers is None else problem.weights_tiers
    for home in [None, *problem.lower]:
        if config.optimizer_states not in ("auto", home.name if home else "compute"):
            continue
        if home is None:
            with_states, notes = owned.resident, ()
        else:
            with_states = states_below(owned.resident, base, owned.resident.stages,
                                       owned.state_of, home, depth > 0)
            notes = (f"the optimizer states ({format_bytes(owned.state_bytes)}) live in "
                     f"{home.about}, {'read ahead of' if depth else 'read at'} each stage's "
                     f"update and written back after ({format_bytes(home.read_bytes_per_s)}/s "
                     f"up, {format_bytes(home.write_bytes_per_s)}/s down)",)
        if config.stream != "all":
            kept = Candidate(with_states, home, None, frozenset(), notes, depth)
            hosted = _updated_on_host(kept, (), problem, owned, config)
            if hosted is None or config.host_updates != "all":
                candidates.append(kept)
            if hosted is not None:
                candidates.append(hosted)
        if home is None or config.stream == "never":
            continue
        for source in sources:
            for streamed in _stream_sets(with_states, problem.streamable, budget, config, tier,
                                         source, depth):
                moved, why = _streaming(with_states, source, frozenset(streamed), depth)
                streams = Candidate(moved, home, source, frozenset(streamed),
                                    notes + (why + " and written back after each update",),
                                    depth)
                hosted = _updated_on_host(streams, (why,), problem, owned, config)
                if hosted is None or config.host_updates != "all":
                    candidates.append(streams)
                if hosted is not None:
                    candidates.append(hosted)
            if home is source and kept_whole:
                candidates += _kept_whole(problem, owned, home, notes, config, depth)
    if config.selective != "never":
        candidates = with_selective(candidates, config)
    if problem.lower and config.offload_tapes != "never":
        candidates = with_offloaded_tapes(candidates, problem.lower[0], config,
                                          problem.min_tape_bytes)
    if problem.lower and config.stash_boundaries != "never":
        candidates = with_stashed_boundaries(candidates, problem.lower[0], config,
                                             problem.min_boundary_bytes)
    return candidates


def _updated_on_host(candidate: Candidate, weights_notes: tuple[str, ...],
                     problem: TierProblem, owned: _Owned, config: FitConfig) -> Candidate | None:
    """``candidate`` (its states in the host RAM below a GPU, or on the disk below that RAM)
    with the updates of its stages run in host RAM, on their twins (exec/host_update.py): a
    resident stage's weights get a host copy; a streamed stage's are stepped where they live
    in host RAM, or read from disk into it for the step and written back after. None when no
    stage qualifies. ``weights_notes`` say where the weights live; the states' note is
    replaced. Deferred updates step them in the update pass (``deferred_costs``)."""
    rates, home = problem.rates, candidate.states
    ram = next((t for t in problem.lower if t.name == "ram"), None)
    if (config.host_updates == "never" or rates.host_seconds_per_byte is None
            or home is None or ram is None):
        return None
    host = frozenset(problem.host_updatable) - candidate.states_kept
    if not host:
        return None
    state_of = candidate.states_below(owned.state_of)
    read_ahead = candidate.depth > 0
    on_disk = host & candidate.streamed if candidate.weights is not ram else frozenset()
    costs = updated_on_host(candidate, problem.costs, state_of, host, ram,
                            rates.host_seconds_per_byte, candidate.weights if on_disk else None,
                            beside_backward=not rates.host_shares_compute)
    size = [problem.costs.stages[i].param_bytes for i in range(problem.costs.length)]
    copies = sum(size[i] for i in host - candidate.streamed)
    # deferred, a stage streamed from host RAM steps from the gradients stashed there
    # (counted with the weights); every other host stage's come down, or up from disk
    stashed = host & candidate.streamed if candidate.weights is ram else frozenset()
    come_down = host - stashed if problem.deferred else host
    # the resident stages' host copies, the step's temporaries, states read from disk, the
    # weights read from disk (the stage stepping's, the next one's when reading ahead, and
    # a buffer kept for a larger stage), and the gradients of the stage stepping and of the
    # next one
    held = copies + max(owned.resident.stages[i].update_transient for i in host) + \
        host_states_in_flight(state_of, host, home, read_ahead) + \
        sum(sorted(size[i] for i in on_disk)[-(3 if read_ahead else 2):]) + \
        2 * max((size[i] for i in come_down), default=0)
    moved = "" if home is ram else (
        f" and come up to it for each step, going back after "
        f"({format_bytes(home.read_bytes_per_s)}/s up, {format_bytes(home.write_bytes_per_s)}/s "
        "down)")
    why = (f"the optimizer steps {len(host)} stages in {ram.about}: their states "
           f"({format_bytes(sum(state_of[i] for i in host))}) live in {home.about}{moved}; "
           f"their gradients go down ({format_bytes(ram.write_bytes_per_s)}/s), and the new "
           "weights come up with the next fetch of a streamed stage, after the step for a "
           "resident one")
    if on_disk:
        why += (f"; the weights of {len(on_disk)} of them come from {candidate.weights.about} "
                "for their step and go back after it, on the host thread")
    others = sum(n for i, n in enumerate(state_of) if i not in host)
    if others:
        why += (f"; the other stages' states ({format_bytes(others)}) come up for their "
                "update and go back after")
    costs = replace(costs, extra={**costs.extra, "host step bytes": held,
                                  "host steps read weights": bool(on_disk)})
    return replace(candidate, costs=costs, notes=weights_notes + (why,), host_stages=host,
                   host=ram)


def _kept_whole(problem: TierProblem, owned: _Owned, home: LowerTier, notes: tuple[str, ...],
                config: FitConfig, depth: int) -> list[Candidate]:
    """Under a budget of ``home`` (the tier of the states and of every streamed stage's
    weights), the placements that keep a few stages whole on the compute tier (weights
    resident, gradients and states beside them, updated there) and stream the rest from
    ``home``: for a tier a little short of every stage's weights, gradients and states.
    The stages kept are the first ``KEPT_WHOLE`` of those that own at least the median
    stage's bytes, fewest bytes first (a decoder layer before the embedding), whatever the
    budget, so that the smallest budget the search names is the least these need; the
    streamed stages stepped in host RAM where they can be. None without a budget and when the
    config streams every stage. ``notes``: the states' own."""
    every = frozenset(problem.streamable)
    if home.budget is None or config.stream == "all":
        return []
    freed = {i: problem.costs.stages[i].weight_bytes + owned.state_of[i] +
             (problem.costs.stages[i].param_bytes if problem.deferred else 0)
             for i in every & set(problem.optimizer_stages)}
    if not freed:
        return []
    median = sorted(freed.values())[len(freed) // 2]
    order = sorted((i for i, n in freed.items() if n >= median), key=lambda i: (freed[i], i))
    out: list[Candidate] = []
    for count in KEPT_WHOLE:
        kept = frozenset(order[:count])
        if count > len(order) or kept >= every:  # nothing would stream: resident candidates
            break
        streams = _streamed_from(problem, owned, home, notes, every - kept, kept, depth)
        hosted = _updated_on_host(streams, streams.notes[-1:], problem, owned, config)
        out.append(hosted or streams)  # stepped in host RAM where it can be (half the plans)
    return out


def _streamed_from(problem: TierProblem, owned: _Owned, home: LowerTier,
                   notes: tuple[str, ...], streamed: frozenset[int], kept: frozenset[int],
                   depth: int) -> Candidate:
    """The candidate whose states and ``streamed`` stages' weights live on ``home``, but
    for the ``kept`` stages' states, which stay on the compute tier."""
    with_states = states_below(owned.resident, problem.costs, owned.resident.stages,
                               owned.state_of, home, depth > 0, kept=kept)
    moved, why = _streaming(with_states, home, streamed, depth)
    if kept:
        why += (f"; {len(kept)} stage(s) stay whole on the compute tier (weights, gradients and "
                f"optimizer states: {format_bytes(sum(owned.state_of[i] for i in kept))} of "
                f"states), so that {home.about} holds the rest")
    return Candidate(moved, home, home, streamed, notes + (why,), depth, states_kept=kept)


def _streaming(costs: ChainCosts, source: LowerTier, streamed: frozenset[int],
               depth: int) -> tuple[ChainCosts, str]:
    """``costs`` with the ``streamed`` stages' weights read from ``source`` ``depth`` stages
    ahead, and why, in words."""
    moved = streamed_costs(costs, set(streamed), home=source.name,
                           read_bytes_per_s=source.read_bytes_per_s,
                           write_bytes_per_s=source.write_bytes_per_s, depth=depth)
    moved = replace(moved, extra={**moved.extra, "weights tier": source.name})
    ahead = f"read {depth} stages ahead of use" if depth else "read when needed"
    return moved, (f"the weights of {len(streamed)} of {costs.length} stages "
                   f"({format_bytes(moved.extra['streamed bytes'])}) live in {source.about}, "
                   f"{ahead}")


def _stream_sets(costs: ChainCosts, streamable: tuple[int, ...], budget: int | None,
                 config: FitConfig, tier: str, source: LowerTier,
                 depth: int) -> list[tuple[int, ...]]:
    """The stage sets worth streaming: every streamable stage, and (under a budget) the
    fewest of the largest stages that make a plan fit, found by bisection."""
    order = sorted(streamable, key=lambda i: -costs.stages[i].weight_bytes)
    if not order:
        return []
    every = tuple(sorted(order))
    if budget is None or config.stream == "all":
        return [every]

    def fits(count: int) -> bool:
        moved = streamed_costs(costs, set(order[:count]), home=source.name,
                               read_bytes_per_s=source.read_bytes_per_s,
                               write_bytes_per_s=source.write_bytes_per_s, depth=depth)
        try:
            make_plan(moved, budget, config, tier=tier)
        except BudgetError:
            return False
        return True

    if not fits(len(order)):
        return [every]  # the candidate's own error will say what is missing
    low, high = 0, len(order)  # fits(high) holds
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    fewest = tuple(sorted(order[:high]))
    return [fewest] if fewest == every else [fewest, every]
