"""``tierflow plan`` on the cpu profile with a disk tier: the trainer's own placement search
(``plan/tier_search.py``) run on analytic costs.

``tierflow train --disk`` plans with that search on the costs it profiles. Predicting with
it too means the prediction chooses among the same placements (optimizer states, streamed
weights, offloaded tapes, prefetch depth, LM-head chunk), priced the same way, with the
profile's rates where the trainer has its own measurements: the AdamW rate and the disk's
read and write rates of ``tierflow calibrate``. The result is a ``Placement``, so that
``tierflow plan`` and ``tierflow sweep`` report it like the GPU planner's.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import FitConfig
from ..errors import BudgetError
from ..plan.ops import Fetch, Forward
from ..plan.placement_problem import (
    KindPlacement,
    Placement,
    PlacementError,
    infeasible_error,
)
from ..plan.tier_candidates import TierProblem, UpdateRates
from ..plan.tier_costs import LowerTier
from ..plan.tier_search import (
    LARGE_HEAD_CHUNK,
    SMALL_HEAD_CHUNK,
    TierPlan,
    TierSearch,
    auto_head_chunk,
)
from .setup import Setup
from .stages import StepShape, chain_costs

COMPUTE_TIER = "ram"
# Temporaries of one step of the trainer's AdamW (precision/adamw.py), by moment dtype, on
# fp32 weights: it works through a parameter 4M elements at a time in one step-long workspace,
# so they do not grow with it. Measured by profile/optimizer_probe.probe_optimizer, the probe
# the trainer prices them with (tests/test_tiered_prediction.py checks them against it).
ADAMW_TRANSIENT_BYTES = {"fp32": 16 << 20, "bf16": 48 << 20, "int8": 48 << 20}
ADAMW_BF16_GRAD_BYTES = 16 << 20  # bf16 weights: the gradient's float32 copy, one slice more


def adamw_transient_bytes(optim_dtype: str, weight_bytes: float) -> int:
    """The trainer's AdamW temporaries for moments in ``optim_dtype`` and weights of
    ``weight_bytes`` bytes per parameter (2: bf16)."""
    return ADAMW_TRANSIENT_BYTES[optim_dtype] + (ADAMW_BF16_GRAD_BYTES if weight_bytes == 2
                                                 else 0)


def tiered_placement(setup: Setup) -> Placement:
    """The placement ``tierflow train --disk`` would choose for ``setup`` (RAM the compute
    tier, a disk tier below it); PlacementError with the smallest budget per tier if none
    fits."""
    config = FitConfig()
    try:
        search, placed = auto_head_chunk(
            lambda chunk: _searched(_problem(setup, chunk), setup.ram, config),
            lambda result: result[1])
    except BudgetError:
        raise _nothing_fits(setup, config) from None
    return _as_placement(setup, search.problem, placed, search.smallest_budgets())


def _searched(problem: TierProblem, ram: int | None,
              config: FitConfig) -> tuple[TierSearch, TierPlan]:
    search = TierSearch(problem, ram, config, COMPUTE_TIER)
    return search, search.best()


def _problem(setup: Setup, head_chunk: int) -> TierProblem:
    """What the trainer would know before placing: the chain's costs (analytic here), the
    optimizer's rates, each stage's largest trainable parameter, the disk tier's rate and
    budget."""
    hw, shape, prec = setup.hardware, setup.shape, setup.run_precision
    per = prec.bytes_per_parameter()
    costs = chain_costs(shape, StepShape(setup.seq, setup.batch), prec, hw,
                        head_chunk=head_chunk, selection=setup.selection)
    width = per.weights
    # a tied embedding is shared with the head and stays resident: the embedding stage has
    # nothing else to stream unless it has learned positions
    streamable = tuple(i for i in range(costs.length)
                       if i > 0 or not shape.tied or shape.positions)
    if setup.disk_bw is not None:
        bandwidth = setup.disk_bw
    else:  # a write then a read of the same bytes, as the trainer measures its disk
        bandwidth = 2 / (1 / hw.disk_read_bw + 1 / hw.disk_write_bw)
    disk = LowerTier("disk", bandwidth, setup.disk_budget, "the disk tier")
    return TierProblem(
        costs=costs,
        rates=UpdateRates(per.optimizer_state / per.weights,
                          per.update_traffic / hw.update_bw(prec.optim_dtype) / per.weights,
                          transient_per_byte=0.0,
                          transient_bytes=adamw_transient_bytes(prec.optim_dtype, width)),
        largest=tuple(int(n * width) for n in setup.trains.largest),
        trainable=int(setup.trains.total * width), streamable=streamable, lower=(disk,),
        deferred=setup.grad_accum > 1, accumulates=setup.grad_accum > 1)


def _nothing_fits(setup: Setup, config: FitConfig) -> PlacementError:
    """The error naming the smallest budget of each tier, over both LM-head chunks."""
    problems = [_problem(setup, chunk) for chunk in (LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK)]

    def least(budget: int | None, lifted: bool) -> dict[str, int | None]:
        found: dict[str, int | None] = {}
        for problem in problems:
            if lifted:
                problem = _unbounded_lower(problem)
            search = TierSearch(problem, budget, config, COMPUTE_TIER)
            for tier, value in search.smallest_budgets().items():
                if value is not None:
                    found[tier] = value if found.get(tier) is None else min(found[tier], value)
                found.setdefault(tier, None)
        return found

    budgets = {COMPUTE_TIER: setup.ram, "disk": setup.disk_budget}
    smallest = least(setup.ram, lifted=False)
    floors = {COMPUTE_TIER: least(setup.ram, lifted=True)[COMPUTE_TIER] or 0,
              "disk": least(None, lifted=False)["disk"] or 0}
    return infeasible_error(budgets, smallest, floors)


def _unbounded_lower(problem: TierProblem) -> TierProblem:
    return replace(problem, lower=tuple(replace(t, budget=None) for t in problem.lower))


def _as_placement(setup: Setup, problem: TierProblem, placed: TierPlan,
                  smallest: dict[str, int | None]) -> Placement:
    """``placed`` in the terms ``tierflow plan`` reports: where each kind lives, the peak
    and busy time of each tier, the step time and what bounds it."""
    costs, accum, plan = problem.costs, setup.grad_accum, placed.plan
    n = costs.length
    streamed = tuple(sorted(placed.streamed))
    weights = KindPlacement(n - len(streamed), "disk", streamed or None)
    grads = weights if problem.deferred and streamed else KindPlacement(n, "disk")
    optimizer = KindPlacement(0 if placed.states else n, "disk")
    recomputed = len(plan.recomputed_stages())
    stashed = plan.stashed_boundaries()
    mode = "offload" if placed.tapes else ("recompute" if recomputed else "keep")
    mode = "offload+recompute" if stashed else mode
    peaks = {COMPUTE_TIER: placed.predicted_peak,
             "disk": dict(placed.held).get("disk", 0)}
    step = plan.predicted_time * accum + (placed.update_pass.seconds if placed.update_pass
                                          else 0.0)
    # bytes over the disk link per step: streamed weights read for each forward and
    # backward (a forward-only stage's for its forward alone) and the trainable ones written
    # after the update; states read and written once; offloaded tapes written and read once
    # per micro-batch, stashed checkpoints written once and read at each fetch
    weights_read = sum(costs.stages[i].weight_bytes * (1 + costs.stages[i].needs_backward)
                       for i in streamed)
    weights_written = sum(costs.stages[i].param_bytes for i in streamed)
    state_bytes = int(problem.rates.state_per_byte * problem.trainable) if placed.states else 0
    tape_bytes = sum(costs.stages[i].tape for i in placed.tape_stages)
    stash_written = sum(plan.costs.x_bytes(i) for i in stashed)
    stash_read = sum(plan.costs.x_bytes(op.index) for op in plan.ops if isinstance(op, Fetch))
    bandwidth = problem.lower[0].bandwidth
    forwards = sum(costs.stages[op.stage].fwd_time for op in plan.ops if isinstance(op, Forward))
    times = {"compute": accum * (forwards + sum(s.bwd_time for s in costs.stages))
             + problem.rates.seconds_per_byte * problem.trainable,
             "disk->ram": (accum * weights_read + state_bytes
                           + accum * (tape_bytes + stash_read)) / bandwidth,
             "ram->disk": (weights_written + state_bytes
                           + accum * (tape_bytes + stash_written)) / bandwidth}
    name, seconds = max(times.items(), key=lambda kv: kv[1])
    what = ("compute-bound: the matmuls, element-wise kernels and AdamW" if name == "compute"
            else f"the {name} link, moving weights, optimizer states, tapes or checkpoints")
    return Placement(
        compute_tier=COMPUTE_TIER, stages=n, weights=weights, grads=grads, optimizer=optimizer,
        activations=mode, recomputed=recomputed, prefetch=placed.depth, peaks=peaks,
        budgets={COMPUTE_TIER: setup.ram, "disk": setup.disk_budget}, times=times,
        step_time=step, bottleneck=f"{what} ({seconds:.3g} s, {seconds / step:.0%} of the step)",
        smallest=smallest,
        notes=(f"placed by the trainer's own search (plan/tier_search.py) on analytic costs, "
               f"LM head in chunks of {plan.costs.extra.get('head chunk', '?')} tokens",
               *plan.notes))
