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

from ..core.config import FitConfig
from ..core.errors import BudgetError, TierflowError
from ..core.units import format_bytes
from .boundary_schedule import BOUNDARY
from .choose import budget_for, make_plan
from .costs import ChainCosts
from .gradient_schedule import GRADS
from .kept_below import KeptBelow
from .ops import TRANSFERS, Store
from .plan import Plan
from .rotor import smallest_budget
from .state_schedule import STATES
from .streaming import TRANSFER_RESOURCES
from .tape_offload import activation_tape
from .tape_schedule import TAPE
from .tier_candidates import TierProblem, all_candidates
from .tier_costs import (
    Candidate,
    LowerTier,
    UpdatePass,
    deferred_costs,
    lower_bytes,
    offload_tapes,
    stash_boundaries,
    with_update_pass,
)
from .timeline import timeline
from .transfers import Transfers
from .weight_schedule import StreamedWeights

LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK = 1024, 256  # tokens per chunk of the fused LM head
# placements predicted within this share of the fastest are a tie, won by the one that moves
# the fewest bytes between tiers (see ``TierSearch.best``)
NEAR_TIE = 0.01
Planned = TypeVar("Planned")


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
    micro_batches: int = 1  # per optimizer step, each running the plan once
    states_kept: frozenset[int] = frozenset()  # stages whose states stay on the compute tier

    @property
    def predicted_time(self) -> float:
        """Seconds of one optimizer step: its micro-batches, then the update pass (once)."""
        return self.plan.step_time(self.micro_batches) + (
            self.update_pass.seconds if self.update_pass else 0.0)

    @property
    def predicted_peak(self) -> int:
        """Bytes of the compute tier at the step's peak: the plan's or the update pass's."""
        return with_update_pass(self.plan.predicted_peak, self.update_pass)

    @property
    def moved_bytes(self) -> int:
        """Bytes its transfer ops move in a step: a micro-batch's, the reads between steps
        and the update pass's."""
        r = self.plan.routines
        return sum(getattr(op, "nbytes", 0) for op in (*self.plan.ops, *r.between,
                                                      *r.update_pass)
                   if isinstance(op, TRANSFERS))

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
        self._candidates, self._state_of = all_candidates(problem, budget, config, tier)
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
        """The fastest placement that fits every tier; the closest one's BudgetError if none.

        Placements predicted within ``NEAR_TIE`` of the fastest are a tie, and the one of
        them that moves the fewest bytes wins: a prediction is a few percent off the step it
        predicts, so 1% on paper is no faster in fact, and the fewer bytes a plan moves, the
        less its time hangs on the rates measured for the tiers. It also keeps the choice
        from tipping on a few MiB: `tierflow plan --measure` and the trainer measure the
        same model within a few MiB of each other, and W2 at 8 GiB had two placements 0.1%
        apart (every weight in RAM, or 23 stages' streamed from the disk), which the two
        ordered differently.

        A placement that offloads tapes is also planned offloading fewer, as many as the
        room its plan leaves under the budget keeps in memory (``_fewer_tapes_below``), and
        competes with the others: on a tie it moves fewer bytes. A placement planned with
        more room (``_roomier``) wins only where it is faster than that choice by more than
        a tie: the memory it takes buys time, not noise."""
        plans = [placed for _, placed in self._fitting()]
        if plans:
            chosen = _least_moved_of_the_fastest(plans + self._fewer_tapes_plans())
            faster = [roomy for roomy in self._roomier_plans()
                      if roomy.predicted_time < chosen.predicted_time * (1 - NEAR_TIE)]
            return _least_moved_of_the_fastest(faster) if faster else chosen
        errors = [error for _, error in self._outcomes if error is not None]
        if not errors:
            least = format_bytes(self.problem.min_tape_bytes)
            raise TierflowError(f"offload_tapes='all' but no stage saves {least} or more for "
                                "its backward: use offload_tapes='auto'")
        raise min(errors, key=lambda e: e.smallest)

    def _fewer_tapes_plans(self) -> list[TierPlan]:
        """The placements that fit and offload tapes, each planned offloading fewer where
        its budget has room for them (``_fewer_tapes_below``)."""
        if self.budget is None or self.config.offload_tapes == "all":
            return []
        found = (_fewer_tapes_below(placed, candidate, self.problem, self._state_of,
                                    self.budget, self.config, self.tier)
                 for candidate, placed in self._fitting() if candidate.before_offload)
        return [fewer for fewer in found if fewer is not None]

    def _roomier_plans(self) -> list[TierPlan]:
        """The placements that fit, each planned with the room its buffers leave where
        that makes it faster (``_roomier``)."""
        found = (_roomier(placed, candidate, self.problem, self._state_of, self.budget,
                          self.config, self.tier)
                 for candidate, placed in self._fitting())
        return [roomy for roomy in found if roomy is not None]

    def _fitting(self) -> list[tuple[Candidate, TierPlan]]:
        """Each placement whose plan fits every tier, with that plan."""
        return [(candidate, placed)
                for candidate, (placed, error) in zip(self._candidates, self._outcomes)
                if error is None]

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
                costs, pass_peak = _costs(candidate, problem, self._state_of)
                need = budget_for(costs, smallest_budget(costs), self.config)
                least[tier].append(max(need, pass_peak or 0))
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


def _costs(candidate: Candidate, problem: TierProblem,
           state_of: list[int]) -> tuple[ChainCosts, int | None]:
    """What the plan of ``candidate`` is made from, and the compute tier's peak of the update
    pass when updates are deferred (None: they are not)."""
    costs, pass_peak = candidate.costs, None
    if problem.deferred:
        costs, pass_peak = deferred_costs(candidate, problem.costs, state_of,
                                          largest=problem.largest,
                                          accumulates=problem.accumulates)
    if candidate.tiers:
        costs = replace(costs, extra={**costs.extra, "prefetch depth": candidate.depth})
    return costs, pass_peak


def _held(candidate: Candidate, problem: TierProblem, state_of: list[int]) -> dict[str, int]:
    """Bytes the candidate keeps on each lower tier it uses, what the tier holds beyond the
    copies included (``LowerTier.held_bytes``)."""
    return {lower.name: lower.held_bytes(lower_bytes(candidate, problem.costs, state_of, lower,
                                                     problem.deferred))
            for lower in {id(t): t for t in candidate.tiers}.values()}


def _plan(candidate: Candidate, problem: TierProblem, state_of: list[int], budget: int | None,
          config: FitConfig, tier: str) -> TierPlan:
    """The candidate's plan, checked against the compute tier's budget (BudgetError if over)."""
    costs, pass_peak = _costs(candidate, problem, state_of)
    notes = candidate.notes
    try:
        plan = make_plan(costs, budget, config, tier=tier)
    except BudgetError as e:  # the smallest budget that works must hold the update pass too
        if pass_peak is None or pass_peak <= e.smallest:
            raise
        raise _update_pass_error(pass_peak, budget, tier) from None
    if pass_peak is not None and budget is not None and pass_peak > budget:
        raise _update_pass_error(pass_peak, budget, tier)
    held = tuple(_held(candidate, problem, state_of).items())
    plan = plan.with_transfers(Transfers(streamed_weights(candidate, problem, tier),
                                         stored_states(candidate, problem, state_of, tier),
                                         _update_order(candidate, problem),
                                         offloaded_tapes(candidate, problem, tier),
                                         stashed_boundaries(candidate, costs, tier),
                                         stashed_gradients(candidate, problem, tier),
                                         problem.accumulates, candidate.host_stages,
                                         host_gradients(candidate, problem, tier)))
    update_pass = None
    if pass_peak is not None:  # its time: its ops, each Update at its in-backward price
        update_pass = UpdatePass(timeline(candidate.costs, plan.routines.update_pass).time,
                                 pass_peak)
        notes = notes + (f"updates run after the backward (gradient accumulation or "
                         f"clipping): one pass over the stages, last first, predicted "
                         f"{update_pass.seconds:.1f} s at a peak of "
                         f"{format_bytes(update_pass.peak)}",)
    return TierPlan(replace(plan, notes=plan.notes + notes), candidate.states,
                    candidate.weights, candidate.streamed, update_pass, candidate.tapes,
                    candidate.tape_stages, candidate.depth, held, candidate.boundaries,
                    candidate.host_stages, problem.micro_batches, candidate.states_kept)


def streamed_weights(candidate: Candidate, problem: TierProblem,
                     tier: str) -> StreamedWeights | None:
    """What ``candidate`` streams, for the weight schedule (None: nothing)."""
    if not candidate.streamed:
        return None
    home = candidate.weights.name
    resources = TRANSFER_RESOURCES[home]
    return StreamedWeights(
        sizes=tuple((i, problem.costs.stages[i].weight_bytes, problem.costs.stages[i].param_bytes)
                    for i in sorted(candidate.streamed)),
        home=home, compute="ram" if tier == "ram" else "gpu", read=resources[0],
        write=resources[1], depth=candidate.depth,
        written_back=not problem.deferred, host_updated=candidate.host_stages,
        tapes_below=candidate.tape_stages)


def stored_states(candidate: Candidate, problem: TierProblem, state_of: list[int],
                  tier: str) -> KeptBelow | None:
    """The optimizer states ``candidate`` keeps on a lower tier and moves beside the updates
    of the compute tier (None: none; the host RAM's own stages move theirs there)."""
    if candidate.states is None:
        return None
    below = candidate.states_below(state_of)
    sizes = tuple((i, below[i]) for i in problem.optimizer_stages
                  if i not in candidate.host_stages and below[i])
    return _kept_below(STATES, sizes, candidate.states, tier, candidate.depth > 0)


def offloaded_tapes(candidate: Candidate, problem: TierProblem, tier: str) -> KeptBelow | None:
    """The tapes ``candidate`` keeps on a lower tier between a stage's forward and its
    backward (None: none), each its stage's activations (the weights a streamed stage's tape
    holds stay with the streamer)."""
    if candidate.tapes is None:
        return None
    sizes = tuple((i, problem.costs.stages[i].tape) for i in sorted(candidate.tape_stages))
    return _kept_below(TAPE, sizes, candidate.tapes, tier, candidate.depth > 0)


def stashed_boundaries(candidate: Candidate, costs: ChainCosts, tier: str) -> KeptBelow | None:
    """The checkpoints the plan made on ``costs`` may stash on ``candidate``'s lower tier
    (None: none), each read one backward ahead whatever the prefetch depth (one checkpoint
    in flight, as the costs count it)."""
    if candidate.boundaries is None:
        return None
    sizes = tuple((a, costs.x_bytes(a)) for a in costs.stashable)
    return _kept_below(BOUNDARY, sizes, candidate.boundaries, tier, read_ahead=True)


def stashed_gradients(candidate: Candidate, problem: TierProblem,
                      tier: str) -> KeptBelow | None:
    """With deferred updates, the gradients of ``candidate``'s streamed stages, kept where
    their weights live between a backward and their next use (None: none): each stage's
    parameters' (the first stage's with the tied ones)."""
    if not problem.deferred or not candidate.streamed:
        return None
    base = problem.costs
    sizes = tuple((i, base.stages[i].param_bytes + (base.shared_grad_bytes if i == 0 else 0))
                  for i in sorted(candidate.streamed))
    return _kept_below(GRADS, sizes, candidate.weights, tier, candidate.depth > 0)


def host_gradients(candidate: Candidate, problem: TierProblem,
                   tier: str) -> KeptBelow | None:
    """The gradients of ``candidate``'s stages stepped in host RAM that the plan copies down
    to it from the compute tier (None: none): every such stage's inside the backward; with
    deferred updates, those not stashed below between micro-batches (a resident stage's,
    and the tied parameters' of a streamed first stage, which stay on the compute tier)."""
    if not candidate.host_stages:
        return None
    stashed = candidate.streamed if problem.deferred else frozenset()
    base = problem.costs
    shared = [base.shared_grad_bytes if i == 0 else 0 for i in range(base.length)]
    sizes = tuple((i, (0 if i in stashed else base.stages[i].param_bytes) + shared[i])
                  for i in sorted(candidate.host_stages)
                  if i not in stashed or shared[i])
    return _kept_below(GRADS, sizes, candidate.host, tier, candidate.depth > 0)


def _kept_below(what: str, sizes: tuple[tuple[int, int], ...], home: LowerTier, tier: str,
                read_ahead: bool) -> KeptBelow | None:
    """``sizes`` of ``what`` kept on ``home`` below the compute tier ``tier`` (None: none)."""
    if not sizes:
        return None
    read, write = TRANSFER_RESOURCES[home.name]
    return KeptBelow(what, sizes, home.name, "ram" if tier == "ram" else "gpu", read, write,
                     read_ahead)


def _update_order(candidate: Candidate, problem: TierProblem) -> tuple[int, ...] | None:
    """The stages the update pass after the backward steps: those stepped in host RAM first
    (the host thread steps them while the compute tier updates the others), then the
    others, each last first (None when updates run inside the backward)."""
    if not problem.deferred:
        return None
    order = sorted(problem.optimizer_stages, reverse=True)
    return tuple([i for i in order if i in candidate.host_stages]
                 + [i for i in order if i not in candidate.host_stages])


def _update_pass_error(peak: int, budget: int, tier: str) -> BudgetError:
    need = format_bytes(peak, round_up=True)
    return BudgetError(f"{tier} budget {format_bytes(budget)} is below what the update pass "
                       f"after the backward needs, {need}: raise {tier} to at least {need}",
                       tier=tier, budget=budget, smallest=peak)


def _fewer_tapes_below(placed: TierPlan, candidate: Candidate, problem: TierProblem,
                       state_of: list[int], budget: int, config: FitConfig,
                       tier: str) -> TierPlan | None:
    """The candidate of ``placed`` (its tapes offloaded) planned again with the tapes of
    its last offloaded stages kept in memory instead: as many as the room ``placed`` leaves
    under ``budget`` holds, else half as many, else a quarter; the first of those plans
    that fits, else None (also when no tape fits the room, or only all of them would; the
    candidate without offloaded tapes is planned on its own). A candidate offloads the tapes
    of every stage or none; the last stages' tapes are the first their backward reads, so
    keeping those saves the reads that could wait least. W1 at 50% of plain PyTorch's peak
    with fp32 matmuls (an AVX2 AMD EPYC) offloaded every stage's tapes to the disk, its
    predicted peak 0.9 GiB under the budget, and ran 1.10x the commit before the one
    schedule."""
    before = candidate.before_offload
    # the stages whose tapes go down (not one whose backward follows its forward at once)
    down = sorted({op.stage for op in placed.plan.ops
                   if isinstance(op, Store) and op.what == TAPE}, reverse=True)
    room = int(budget * (1.0 - config.headroom)) - placed.plan.planned_peak
    kept: list[int] = []
    for i in down:  # the last stages first
        room -= activation_tape(before.costs, i, before.streamed)
        if room < 0:
            break
        kept.append(i)
    kept = kept[:len(down) - 1]  # at least one stays offloaded
    for share in (kept, kept[:len(kept) // 2], kept[:len(kept) // 4]):
        if not share:
            return None
        fewer = offload_tapes(before, candidate.tape_stages - frozenset(share),
                              candidate.tapes)
        if candidate.boundaries is not None:
            fewer = stash_boundaries(fewer, candidate.boundaries,
                                     problem.min_boundary_bytes) or fewer
        try:
            fewer_placed = _plan(fewer, problem, state_of, budget, config, tier)
            _check_lower(fewer, fewer_placed)
        except BudgetError:
            continue
        return fewer_placed
    return None


def _least_moved_of_the_fastest(plans: list[TierPlan]) -> TierPlan:
    """Of the ``plans`` within ``NEAR_TIE`` of the fastest, the one that moves the fewest
    bytes between tiers (see ``TierSearch.best``)."""
    fastest = min(placed.predicted_time for placed in plans)
    near = [placed for placed in plans if placed.predicted_time <= fastest * (1 + NEAR_TIE)]
    return min(near, key=lambda placed: (placed.moved_bytes, placed.predicted_time))


def _roomier(placed: TierPlan, candidate: Candidate, problem: TierProblem,
             state_of: list[int], budget: int | None, config: FitConfig,
             tier: str) -> TierPlan | None:
    """The candidate of ``placed`` (a rotor plan) planned again as if ``budget`` held the
    buffers of transfers in flight its ops may run without (all of them, else half), where
    that plan's predicted peak, those buffers free where its timeline has them free, still
    fits ``budget`` and it is faster than ``placed`` by more than a tie; else None. The
    rotor fits the planned peak, every buffer held by every op; W2 at 2 GiB
    planned 1.99 GiB and predicted 1.65 (one stage's AdamW states, 0.49 GiB, free in the
    forward) and recomputed every stage; planned with that room it is predicted at 69 s a
    step instead of 81, its peak at 1.93 GiB (AMD EPYC, 2 cores)."""
    slack = placed.plan.costs.state_buffer_bytes + placed.plan.costs.tape_buffer_bytes
    if budget is None or not slack or placed.plan.strategy != "rotor":  # it recomputes
        return None
    fits = int(budget * (1.0 - config.headroom))
    for room in (slack, slack // 2):
        try:
            roomier = _plan(candidate, problem, state_of, budget + room, config, tier)
        except BudgetError:
            continue
        faster = roomier.predicted_time < placed.predicted_time * (1 - NEAR_TIE)
        if faster and roomier.predicted_peak <= fits:
            plan = roomier.plan
            note = (f"planned as if {format_bytes(room)} more were free: the buffers of "
                    f"transfers in flight its peak runs without",)
            return replace(roomier, plan=replace(plan, budget=budget, notes=plan.notes + note))
    return None


def _check_lower(candidate: Candidate, placed: TierPlan) -> None:
    """BudgetError when a lower tier cannot hold what the placement keeps there."""
    tiers = {t.name: t for t in candidate.tiers}
    for name, held in placed.held:
        lower = tiers[name]
        if not _fits(lower, held):
            need = format_bytes(held, round_up=True)
            parts = [f"{format_bytes(lower.reserve)} outside any plan"] if lower.reserve else []
            if lower.heap_slack:
                parts.append("the page-locked heap's unused end")
            outside = f" ({' and '.join(parts)} included)" if parts else ""
            # the disk's budget is its free space: no flag raises it
            fix = (f"free space in {lower.about} or give a directory with at least {need} free"
                   if lower.name == "disk" else f"raise {lower.name} to at least {need}")
            raise BudgetError(f"{lower.name} budget {format_bytes(lower.budget)} is below the "
                              f"{need} this placement keeps there{outside}: {fix}",
                              tier=lower.name, budget=lower.budget, smallest=held)


def auto_head_chunk(attempt: Callable[[int], Planned],
                    plan_of: Callable[[Planned], TierPlan], try_large: bool = True) -> Planned:
    """``attempt(tokens)`` plans with LM-head chunks of that many tokens. Large chunks are
    faster, small ones need less memory: take the large one when memory does not bind
    (nothing recomputed or offloaded), else the faster of the two. ``try_large`` False:
    the small chunks alone (the large one's profile would pass the budget by itself)."""
    if not try_large:
        return attempt(SMALL_HEAD_CHUNK)
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
