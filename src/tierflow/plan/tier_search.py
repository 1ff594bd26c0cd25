"""Where a training step keeps the optimizer states, the stage weights, the tapes and the
checkpoints when tierflow owns the optimizer: on the compute tier, or on a tier below it
(the disk; under a simulated GPU, host RAM first, then the disk).

Pure data. The trainer (``tiers.place``: profiled costs, a probe of its optimizer, measured
bandwidths) and ``tierflow plan`` on the cpu profile (``sim/tiered.py``: analytic costs and
the profile's rates) both plan with ``TierSearch``, so a prediction chooses among
exactly the placements a run chooses among, priced the same way.

Every placement that could work is planned (the same rotor plan under the same budget, on
the costs that placement implies), at each prefetch depth unless the config fixes one, and
the fastest plan that fits every tier wins; when nothing fits, the error of the placement
that came closest is raised.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..config import FitConfig
from ..errors import BudgetError, TierflowError
from ..units import format_bytes
from .boundary_stash import MIN_BOUNDARY_BYTES
from .choose import budget_for, make_plan
from .costs import ChainCosts, StageCost
from .plan import Plan
from .rotor import smallest_budget
from .streaming import streamed_costs
from .tape_offload import MIN_TAPE_BYTES
from .tier_costs import (
    Candidate,
    LowerTier,
    UpdatePass,
    deferred_costs,
    host_states_in_flight,
    lower_bytes,
    states_below,
    updated_on_host,
    with_offloaded_tapes,
    with_stashed_boundaries,
    with_update_pass,
)

PREFETCH_DEPTHS = (0, 1, 2)  # what the planner tries when the config leaves the depth open
LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK = 1024, 256  # tokens per chunk of the fused LM head
Planned = TypeVar("Planned")


@dataclass(frozen=True)
class UpdateRates:
    """What one optimizer step costs, per byte of the parameters it updates."""

    state_per_byte: float  # bytes of optimizer state kept between steps
    seconds_per_byte: float
    transient_per_byte: float  # temporaries during a step, per byte of the largest parameter
    transient_bytes: int = 0  # temporaries during a step, whatever the parameter's size
    # the optimizer's step in host RAM below a GPU (None: no such tier, or not measured)
    host_seconds_per_byte: float | None = None


@dataclass(frozen=True)
class TierProblem:
    """Everything the placement depends on besides the budgets and the config.

    ``largest``: per stage, the bytes of its largest parameter; ``trainable``: bytes of the
    trainable parameters; ``streamable``: the stages whose weights may live on a lower tier
    (those no other stage shares); ``lower``: the tiers below the compute tier, nearest
    first; ``weights_tiers``: where weights may stream from (None: any lower tier);
    ``deferred``: updates run in one pass after the backward (accumulation, clipping);
    ``accumulates``: over several micro-batches (each backward adds to gradients it reads
    back); ``host_updatable``: the stages whose parameters the optimizer may step in host RAM (those
    that own trainable parameters)."""

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


@dataclass(frozen=True)
class TierPlan:
    """A plan and where it keeps things: the lower tier of the optimizer states and of the
    streamed stages' weights (None: the compute tier), and, with deferred updates, the
    update pass."""

    plan: Plan
    states: LowerTier | None = None
    weights: LowerTier | None = None
    streamed: frozenset[int] = frozenset()
    update_pass: UpdatePass | None = None
    tapes: LowerTier | None = None  # where the offloaded tapes go
    tape_stages: frozenset[int] = frozenset()
    depth: int = 1  # stages whose weights, states and tapes are read ahead (0: on demand)
    held: tuple[tuple[str, int], ...] = ()  # (lower tier, bytes it holds) for each one used
    boundaries: LowerTier | None = None  # where the plan's Stash ops put checkpoints
    host_stages: frozenset[int] = frozenset()  # stages the optimizer steps in host RAM

    @property
    def predicted_time(self) -> float:
        """Seconds per micro-batch, plus the update pass (once per step of the accumulation)."""
        return self.plan.predicted_time + (self.update_pass.seconds if self.update_pass else 0.0)

    @property
    def predicted_peak(self) -> int:
        """Bytes of the compute tier at the step's peak: the plan's or the update pass's."""
        return with_update_pass(self.plan.predicted_peak, self.update_pass)

    @property
    def on_lower_tiers(self) -> bool:
        return any(t is not None for t in (self.states, self.weights, self.tapes,
                                           self.boundaries))


class TierSearch:
    """Every placement of ``problem`` planned once under ``budget`` (the compute tier's, named
    ``tier``): the fastest that fits (``best``) and, from the same plans, the smallest budget
    per tier (``smallest_budgets``, which ``tierflow plan`` reports beside the choice)."""

    def __init__(self, problem: TierProblem, budget: int | None, config: FitConfig,
                 tier: str) -> None:
        self.problem, self.budget, self.config, self.tier = problem, budget, config, tier
        self._candidates, self._state_of = _all_candidates(problem, budget, config, tier)
        # per candidate: its plan (None: over the compute tier's budget) and why it does not
        # work (None: it does; else the compute tier's or a lower tier's BudgetError)
        self._outcomes: list[tuple[TierPlan | None, BudgetError | None]] = []
        for candidate in self._candidates:
            try:
                placed = _plan(candidate, problem, self._state_of, budget, config, tier)
            except BudgetError as e:
                self._outcomes.append((None, e))
                continue
            try:
                _check_lower(candidate, placed)
            except BudgetError as e:
                self._outcomes.append((placed, e))
                continue
            self._outcomes.append((placed, None))

    def best(self) -> TierPlan:
        """The fastest placement that fits every tier; the closest one's BudgetError if none."""
        plans = [placed for placed, error in self._outcomes if error is None]
        if plans:
            return min(plans, key=lambda placed: placed.predicted_time)
        errors = [error for _, error in self._outcomes if error is not None]
        if not errors:
            least = format_bytes(self.problem.min_tape_bytes)
            raise TierflowError(f"offload_tapes='all' but no stage saves {least} or more for "
                                "its backward: use offload_tapes='auto'")
        raise min(errors, key=lambda e: e.smallest)

    def smallest_budgets(self) -> dict[str, int | None]:
        """Per tier, the smallest budget that works with the others as given: the compute
        tier's over the placements whose lower tiers hold what they keep, each lower tier's
        over the placements that fit the compute budget (None: no placement works whatever
        it is)."""
        problem, tier = self.problem, self.tier
        least: dict[str, list[int]] = {tier: [], **{t.name: [] for t in problem.lower}}
        for candidate, (placed, _) in zip(self._candidates, self._outcomes):
            held = _held(candidate, problem, self._state_of)
            if all(_fits(t, held.get(t.name, 0)) for t in problem.lower):
                costs, update_pass = _costs(candidate, problem, self._state_of)
                need = budget_for(costs, smallest_budget(costs), self.config)
                least[tier].append(with_update_pass(need, update_pass))
            if placed is None:
                continue
            for lower in problem.lower:
                if all(_fits(t, held.get(t.name, 0)) for t in problem.lower if t is not lower):
                    least[lower.name].append(held.get(lower.name, 0))
        return {name: min(values) if values else None for name, values in least.items()}


def place_on_tiers(problem: TierProblem, budget: int | None, config: FitConfig,
                   tier: str) -> TierPlan:
    """The fastest placement whose plan fits ``budget`` on the compute tier (named ``tier``)
    and whose lower tiers hold what it keeps there; the closest one's BudgetError if none."""
    return TierSearch(problem, budget, config, tier).best()


def _fits(lower: LowerTier, held: int) -> bool:
    return lower.budget is None or held <= lower.budget


def _all_candidates(problem: TierProblem, budget: int | None, config: FitConfig,
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
    depths = PREFETCH_DEPTHS if config.prefetch_depth is None else (config.prefetch_depth,)
    candidates: list[Candidate] = []
    for depth in depths:
        candidates += _candidates(problem, resident, stages, state_of, state_bytes, budget,
                                  config, tier, depth)
    return candidates, state_of


def _candidates(problem: TierProblem, resident: ChainCosts, stages: list[StageCost],
                state_of: list[int], state_bytes: int, budget: int | None, config: FitConfig,
                tier: str, depth: int) -> list[Candidate]:
    """The placements read ``depth`` stages ahead: the optimizer states on the compute tier
    or on each lower tier, with the weights of the largest stages (or all) streamed from a
    lower tier too, and each of those with its tapes offloaded."""
    candidates: list[Candidate] = []
    base = problem.costs
    ahead = f"read {depth} stages ahead of use" if depth else "read when needed"
    sources = problem.lower if problem.weights_tiers is None else problem.weights_tiers
    for home in [None, *problem.lower]:
        if config.optimizer_states not in ("auto", home.name if home else "compute"):
            continue
        if home is None:
            with_states, notes = resident, ()
        else:
            with_states = states_below(resident, base, stages, state_of, home, depth > 0)
            notes = (f"the optimizer states ({format_bytes(state_bytes)}) live in {home.about}"
                     f", {'read ahead of' if depth else 'read at'} each stage's update and "
                     f"written back after ({format_bytes(home.bandwidth)}/s)",)
        if config.stream != "all":
            kept = Candidate(with_states, home, None, frozenset(), notes, depth)
            hosted = _updated_on_host(kept, (), problem, stages, state_of, config)
            if hosted is None or config.host_updates != "all":
                candidates.append(kept)
            if hosted is not None:
                candidates.append(hosted)
        if home is None or config.stream == "never":
            continue
        for source in sources:
            for streamed in _stream_sets(with_states, problem.streamable, budget, config, tier,
                                         source.bandwidth, depth):
                moved = streamed_costs(with_states, set(streamed),
                                       read_bytes_per_s=source.bandwidth,
                                       write_bytes_per_s=source.bandwidth, depth=depth)
                moved = replace(moved, extra={**moved.extra, "weights tier": source.name})
                why = (f"the weights of {len(streamed)} of {base.length} stages "
                       f"({format_bytes(moved.extra['streamed bytes'])}) live in "
                       f"{source.about}, {ahead}")
                streams = Candidate(moved, home, source, frozenset(streamed),
                                    notes + (why + " and written back after each update",),
                                    depth)
                hosted = _updated_on_host(streams, (why,), problem, stages, state_of, config)
                if hosted is None or config.host_updates != "all":
                    candidates.append(streams)
                if hosted is not None:
                    candidates.append(hosted)
    if problem.lower and config.offload_tapes != "never":
        candidates = with_offloaded_tapes(candidates, problem.lower[0], config,
                                          problem.min_tape_bytes)
    if problem.lower and config.stash_boundaries != "never":
        candidates = with_stashed_boundaries(candidates, problem.lower[0], config,
                                             problem.min_boundary_bytes)
    return candidates


def _updated_on_host(candidate: Candidate, weights_notes: tuple[str, ...],
                     problem: TierProblem, stages: list[StageCost], state_of: list[int],
                     config: FitConfig) -> Candidate | None:
    """``candidate`` (its states in the host RAM below a GPU, or on the disk below that RAM)
    with the updates of its stages run in host RAM, on their twins (exec/host_update.py): a
    streamed stage's weights must stream from that RAM too, a resident stage's get a host
    copy. None when no stage qualifies. ``weights_notes`` say where the weights live; the
    states' note is replaced. Deferred updates step them in the update pass
    (``deferred_costs``)."""
    rates, home = problem.rates, candidate.states
    ram = next((t for t in problem.lower if t.name == "ram"), None)
    if (config.host_updates == "never" or rates.host_seconds_per_byte is None
            or home is None or ram is None):
        return None
    host = frozenset(i for i in problem.host_updatable
                     if i not in candidate.streamed or candidate.weights is ram)
    if not host:
        return None
    read_ahead = candidate.depth > 0
    costs = updated_on_host(candidate.costs, problem.costs, state_of, host,
                            candidate.streamed, home, ram, rates.host_seconds_per_byte,
                            read_ahead)
    largest = max(problem.costs.stages[i].param_bytes for i in host)
    copies = sum(problem.costs.stages[i].param_bytes for i in host - candidate.streamed)
    # the resident stages' host copies, the step's temporaries, states read from disk, and
    # inside the backward the gradients of the stage stepping and of the next one (deferred,
    # a streamed stage's wait in host RAM anyway)
    held = copies + max(stages[i].update_transient for i in host) + \
        host_states_in_flight(state_of, host, home, read_ahead) + \
        (0 if problem.deferred else 2 * largest)
    moved = "" if home is ram else (
        f" and come up to it for each step, going back after ({format_bytes(home.bandwidth)}/s)")
    why = (f"the optimizer steps {len(host)} stages in {ram.about}: their states "
           f"({format_bytes(sum(state_of[i] for i in host))}) live in {home.about}{moved}; "
           f"their gradients go down ({format_bytes(ram.bandwidth)}/s), and the new weights "
           "come up with the next fetch of a streamed stage, after the step for a resident one")
    others = sum(n for i, n in enumerate(state_of) if i not in host)
    if others:
        why += (f"; the other stages' states ({format_bytes(others)}) come up for their "
                "update and go back after")
    return replace(candidate, costs=costs, notes=weights_notes + (why,), host_stages=host,
                   host=ram, host_bytes=held)


def _costs(candidate: Candidate, problem: TierProblem,
           state_of: list[int]) -> tuple[ChainCosts, UpdatePass | None]:
    """What the plan of ``candidate`` is made from, and the update pass when deferred."""
    costs, update_pass = candidate.costs, None
    if problem.deferred:
        costs, update_pass = deferred_costs(candidate, problem.costs, state_of,
                                            problem.rates.seconds_per_byte,
                                            problem.rates.host_seconds_per_byte or 0.0,
                                            largest=problem.largest,
                                            accumulates=problem.accumulates)
    if candidate.tiers:
        costs = replace(costs, extra={**costs.extra, "prefetch depth": candidate.depth})
    return costs, update_pass


def _held(candidate: Candidate, problem: TierProblem, state_of: list[int]) -> dict[str, int]:
    """Bytes the candidate keeps on each lower tier it uses."""
    return {lower.name: lower_bytes(candidate, problem.costs, state_of, lower, problem.deferred)
            for lower in {id(t): t for t in candidate.tiers}.values()}


def _plan(candidate: Candidate, problem: TierProblem, state_of: list[int], budget: int | None,
          config: FitConfig, tier: str) -> TierPlan:
    """The candidate's plan, checked against the compute tier's budget (BudgetError if over)."""
    costs, update_pass = _costs(candidate, problem, state_of)
    notes = candidate.notes
    try:
        plan = make_plan(costs, budget, config, tier=tier)
    except BudgetError as e:  # the smallest budget that works must hold the update pass too
        if update_pass is None or update_pass.peak <= e.smallest:
            raise
        raise _update_pass_error(update_pass, budget, tier) from None
    if update_pass is not None:
        if budget is not None and update_pass.peak > budget:
            raise _update_pass_error(update_pass, budget, tier)
        notes = notes + (f"updates run after the backward (gradient accumulation or "
                         f"clipping): one pass over the stages, last first, predicted "
                         f"{update_pass.seconds:.1f} s at a peak of "
                         f"{format_bytes(update_pass.peak)}",)
    held = tuple(_held(candidate, problem, state_of).items())
    return TierPlan(replace(plan, notes=plan.notes + notes), candidate.states,
                    candidate.weights, candidate.streamed, update_pass, candidate.tapes,
                    candidate.tape_stages, candidate.depth, held, candidate.boundaries,
                    candidate.host_stages)


def _update_pass_error(update_pass: UpdatePass, budget: int, tier: str) -> BudgetError:
    need = format_bytes(update_pass.peak, round_up=True)
    return BudgetError(f"{tier} budget {format_bytes(budget)} is below what the update pass "
                       f"after the backward needs, {need}: raise {tier} to at least {need}",
                       tier=tier, budget=budget, smallest=update_pass.peak)


def _check_lower(candidate: Candidate, placed: TierPlan) -> None:
    """BudgetError when a lower tier cannot hold what the placement keeps there."""
    tiers = {t.name: t for t in candidate.tiers}
    for name, held in placed.held:
        lower = tiers[name]
        if not _fits(lower, held):
            need = format_bytes(held, round_up=True)
            raise BudgetError(f"{lower.name} budget {format_bytes(lower.budget)} is below the "
                              f"{need} this placement keeps there: raise {lower.name} to at "
                              f"least {need}", tier=lower.name, budget=lower.budget,
                              smallest=held)


def _stream_sets(costs: ChainCosts, streamable: tuple[int, ...], budget: int | None,
                 config: FitConfig, tier: str, bandwidth: float,
                 depth: int) -> list[tuple[int, ...]]:
    """The stage sets worth streaming: every streamable stage, and (under a budget) the
    fewest of the largest stages that make a plan fit, found by bisection."""
    order = sorted(streamable, key=lambda i: -costs.stages[i].param_bytes)
    if not order:
        return []
    every = tuple(sorted(order))
    if budget is None or config.stream == "all":
        return [every]

    def fits(count: int) -> bool:
        moved = streamed_costs(costs, set(order[:count]), read_bytes_per_s=bandwidth,
                               write_bytes_per_s=bandwidth, depth=depth)
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


def auto_head_chunk(attempt: Callable[[int], Planned],
                    plan_of: Callable[[Planned], TierPlan]) -> Planned:
    """``attempt(tokens)`` plans with LM-head chunks of that many tokens. Large chunks are
    faster, small ones need less memory: take the large one when memory does not bind
    (nothing recomputed or offloaded), else the faster of the two."""
    try:
        large = attempt(LARGE_HEAD_CHUNK)
    except BudgetError:
        return attempt(SMALL_HEAD_CHUNK)
    if not plan_of(large).plan.recomputed_stages() and not plan_of(large).on_lower_tiers:
        return large
    try:
        small = attempt(SMALL_HEAD_CHUNK)
    except BudgetError:
        return large
    return min(large, small, key=lambda result: plan_of(result).predicted_time)
