"""``tierflow plan`` and ``sweep``: the trainer's own placement search (``plan/tier_search.py``)
run on analytic costs, for any hardware profile, or on costs measured here (``measured.py``).

``fit`` and ``tierflow train`` plan with that search on the costs they profile. Predicting
with it too means that a prediction chooses among exactly the placements a run chooses
among (optimizer states, streamed weights, host updates, offloaded tapes, stashed
checkpoints, prefetch depth, LM-head chunk), as the same plan of ops, priced by the same
task graph (``plan/timeline.py``), with the profile's rates where the trainer has its own
measurements: the compute tier's matmuls and memory, the host link, the host's AdamW, the
disk's read and write rates. The result is reported as a ``Placement``.
"""
from __future__ import annotations

from dataclasses import replace

from ..core.config import PINNED_SEGMENT_BYTES, FitConfig
from ..core.errors import BudgetError
from ..core.units import format_bytes
from ..plan.placement import (
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

# Temporaries of one step of the trainer's AdamW (precision/adamw.py), by moment dtype, on
# fp32 weights: it works through a parameter 4M elements at a time in one step-long workspace,
# so they do not grow with it. Measured by profile/optimizer_probe.probe_optimizer, the probe
# the trainer prices them with (tests/test_tiered_prediction.py checks them against it).
ADAMW_TRANSIENT_BYTES = {"fp32": 16 << 20, "bf16": 48 << 20, "int8": 48 << 20}
ADAMW_BF16_GRAD_BYTES = 16 << 20  # bf16 weights: the gradient's float32 copy, one slice more
BOUNDS = {"compute": "compute-bound: the matmuls, element-wise kernels and updates",
          "copy up": "the host link up (weights and optimizer states to the GPU)",
          "copy down": "the host link down (weights and optimizer states back)",
          "disk read": "the disk's reads (weights, optimizer states)",
          "disk write": "the disk's writes (weights, optimizer states)",
          "host optimizer": "the optimizer's steps in host RAM",
          "update pass": "the update pass after the backward"}


def adamw_transient_bytes(optim_dtype: str, weight_bytes: float) -> int:
    """The trainer's AdamW temporaries for moments in ``optim_dtype`` and weights of
    ``weight_bytes`` bytes per parameter (2: bf16)."""
    return ADAMW_TRANSIENT_BYTES[optim_dtype] + (ADAMW_BF16_GRAD_BYTES if weight_bytes == 2
                                                 else 0)


def tiered_placement(setup: Setup, *, smallest_budgets: bool = True) -> Placement:
    """The placement ``tierflow train`` would choose for ``setup``, with the smallest budget
    per tier. When none fits: the PlacementError that names them (several more searches).
    Without ``smallest_budgets``, neither: no smallest budgets, and the closest placement's
    BudgetError when none fits."""
    config = FitConfig()
    tier, budget = compute_tier(setup)
    try:
        search, placed = auto_head_chunk(
            lambda chunk: _searched(_problem(setup, chunk), budget, config, tier),
            lambda result: result[1], try_large=LARGE_HEAD_CHUNK in _chunks(setup))
    except BudgetError:
        if not smallest_budgets:
            raise
        raise _nothing_fits(setup, config) from None
    smallest = search.smallest_budgets() if smallest_budgets else {}
    return _as_placement(setup, search.problem, placed, smallest)


def compute_tier(setup: Setup) -> tuple[str, int | None]:
    """The compute tier's name and budget: the GPU's (its profile's memory unless given),
    or RAM's on a machine without one, less what a trainer's process held outside its plan
    where ``setup`` plans on that trainer's measurements (as the trainer plans)."""
    hw = setup.hardware
    if hw.has_gpu:
        return "gpu", setup.gpu if setup.gpu is not None else hw.gpu_bytes
    return "ram", None if setup.ram is None else max(1, setup.ram - _held_outside(setup))


def _held_outside(setup: Setup) -> int:
    """Bytes of --ram the trainer whose measurements ``setup`` plans on held outside its
    plan (on a CPU; 0 otherwise)."""
    if setup.measured is None or setup.hardware.has_gpu:
        return 0
    return setup.measured.held


def _searched(problem: TierProblem, budget: int | None, config: FitConfig,
              tier: str) -> tuple[TierSearch, TierPlan]:
    search = TierSearch(problem, budget, config, tier)
    return search, search.best()


def _problem(setup: Setup, head_chunk: int) -> TierProblem:
    """What the trainer would know before placing: the chain's costs (analytic, or measured
    by ``tierflow plan --measure``), the optimizer's rates on the compute tier and in host
    RAM below a GPU, each stage's largest trainable parameter, the tiers below with their
    rates and budgets."""
    hw, shape, prec = setup.hardware, setup.shape, setup.run_precision
    per = prec.bytes_per_parameter()
    if setup.measured is not None:
        costs = setup.measured.costs[head_chunk]
    else:
        costs = chain_costs(shape, StepShape(setup.seq, setup.batch), prec, hw,
                            head_chunk=head_chunk, selection=setup.selection)
    width = per.weights
    # a tied embedding is shared with the head and stays resident: the embedding stage has
    # nothing else to stream unless it has learned positions
    streamable = tuple(i for i in range(costs.length)
                       if i > 0 or not shape.tied or shape.positions)
    host = per.update_traffic / hw.update_bw(prec.optim_dtype) / per.weights
    if hw.has_gpu:  # the update on the GPU runs at its memory bandwidth
        seconds_per_byte = per.update_traffic / (hw.memory_bw * hw.memory_efficiency) / width
    else:
        seconds_per_byte = host
    trains = setup.trains
    updated = tuple(i for i, n in enumerate(trains.trainable) if n)
    rates = setup.measured.rates if setup.measured is not None else \
        UpdateRates(per.optimizer_state / width, seconds_per_byte, transient_per_byte=0.0,
                    transient_bytes=adamw_transient_bytes(prec.optim_dtype, width),
                    host_seconds_per_byte=host if hw.has_gpu else None)
    return TierProblem(
        costs=costs, rates=rates,
        largest=tuple(int(n * width) for n in trains.largest),
        trainable=int(trains.total * width), streamable=streamable, lower=lower_tiers(setup),
        deferred=setup.grad_accum > 1 or setup.clips, accumulates=setup.grad_accum > 1,
        micro_batches=setup.grad_accum,
        host_updatable=updated if hw.has_gpu else (), updated=updated)


def _chunks(setup: Setup) -> tuple[int, ...]:
    """The LM-head chunk sizes (tokens) the trainer would try: those measured, or both."""
    if setup.measured is not None:
        return tuple(setup.measured.costs)
    return LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK


def lower_tiers(setup: Setup) -> tuple[LowerTier, ...]:
    """The tiers below the compute tier, nearest first: host RAM below a GPU (over its
    link), the disk when ``setup`` has one (at the profile's read and write rates, unless
    ``disk_bw`` says)."""
    hw = setup.hardware
    tiers = []
    if hw.has_gpu:  # less what the trainer cannot plan with there (LowerTier.reserve)
        tiers.append(LowerTier("ram", hw.host_link_bw, hw.host_link_bw, setup.ram,
                               "host RAM (the tier below the GPU)",
                               reserve=hw.host_runtime_bytes,
                               heap_slack=PINNED_SEGMENT_BYTES))
    if setup.disk:
        read, write = setup.disk_bw if setup.disk_bw is not None else \
            (hw.disk_read_bw, hw.disk_write_bw)
        tiers.append(LowerTier("disk", read, write, setup.disk_budget, "the disk tier"))
    return tuple(tiers)


def _nothing_fits(setup: Setup, config: FitConfig) -> PlacementError:
    """The error naming the smallest budget of each tier, over both LM-head chunks."""
    tier, budget = compute_tier(setup)
    problems = [_problem(setup, chunk) for chunk in _chunks(setup)]

    def least(compute_budget: int | None, lifted: bool) -> dict[str, int | None]:
        found: dict[str, int | None] = {}
        for problem in problems:
            if lifted:
                problem = replace(problem, lower=tuple(replace(t, budget=None)
                                                       for t in problem.lower))
            search = TierSearch(problem, compute_budget, config, tier)
            for name, value in search.smallest_budgets().items():
                if value is not None:
                    found[name] = value if found.get(name) is None else min(found[name], value)
                found.setdefault(name, None)
        return found

    budgets = {tier: budget, **{t.name: t.budget for t in lower_tiers(setup)}}
    smallest = least(budget, lifted=False)
    floors = {tier: least(budget, lifted=True)[tier] or 0}
    unlimited = least(None, lifted=False)
    floors.update({t.name: unlimited.get(t.name) or 0 for t in lower_tiers(setup)})
    return infeasible_error(budgets, smallest, floors)


def _as_placement(setup: Setup, problem: TierProblem, placed: TierPlan,
                  smallest: dict[str, int | None]) -> Placement:
    """``placed`` in the terms ``tierflow plan`` reports: where each kind lives, the peak of
    each tier, each resource's busy seconds per step (the plan's timeline), the step time
    and what bounds it."""
    accum, plan = setup.grad_accum, placed.plan
    tier, budget = compute_tier(setup)
    n = problem.costs.length
    streamed = tuple(sorted(placed.streamed))
    home = placed.weights.name if placed.weights else tier
    weights = KindPlacement(n - len(streamed), home, streamed or None)
    grads = weights if problem.deferred and streamed else KindPlacement(n, tier)
    kept = placed.states_kept  # stages whose states stay beside their resident weights
    optimizer = KindPlacement(len(kept) if placed.states else n,
                              placed.states.name if placed.states else tier,
                              tuple(sorted(set(range(n)) - kept)) if kept else None)
    recomputed = len(plan.recomputed_stages())
    mode = "offload" if placed.tapes else ("recompute" if recomputed else "keep")
    mode = "offload+recompute" if plan.stashed_boundaries() else mode
    line = plan.timeline
    times = {resource: accum * line.busy(resource) for resource in BOUNDS
             if resource != "update pass" and (line.busy(resource) or resource == "compute")}
    if placed.update_pass is not None:
        times["update pass"] = placed.update_pass.seconds
    step = placed.predicted_time
    name, seconds = max(times.items(), key=lambda kv: kv[1])
    lower = lower_tiers(setup)
    source = "analytic costs"
    if setup.measured is not None:
        source = f"costs measured by {setup.measured.origin}" if setup.measured.origin \
            else "costs measured here"
    notes = [f"placed by the trainer's own search (plan/tier_search.py) on {source}, "
             f"LM head in chunks of {plan.costs.extra.get('head chunk', '?')} tokens"]
    held = _held_outside(setup) if budget is not None else 0
    if held:  # the peak and the budgets are the trainer's RSS above its baseline
        notes.append(f"planned under {format_bytes(budget)}: --ram less the "
                     f"{format_bytes(held)} the trainer's process held outside its plan "
                     "(counted in the peak and the smallest budget shown)")
        budget += held
        smallest = {name: value + held if name == tier and value is not None else value
                    for name, value in smallest.items()}
    if placed.host_stages:
        notes.append(f"the optimizer steps {len(placed.host_stages)} stages in host RAM")
    return Placement(
        compute_tier=tier, stages=n, weights=weights, grads=grads, optimizer=optimizer,
        activations=mode, recomputed=recomputed, prefetch=placed.depth,
        peaks={tier: placed.predicted_peak + held, **{t.name: dict(placed.held).get(t.name, 0)
                                               for t in lower}},
        budgets={tier: budget, **{t.name: t.budget for t in lower}}, times=times,
        step_time=step,
        bottleneck=f"{BOUNDS[name]} ({seconds:.3g} s, {seconds / step:.0%} of the step)",
        smallest=smallest, notes=(*notes, *plan.notes), selective=len(plan.costs.selective),
        decisions=plan.decisions())
