"""Pick a strategy for a budget and make its Plan; say why, or say what budget would work."""
from __future__ import annotations

from ..core.config import FitConfig
from ..core.errors import BudgetError
from ..core.units import format_bytes
from .costs import ChainCosts
from .plan import Plan
from .rotor import Infeasible, rotor, smallest_budget
from .selective import mark_selective, selectable, selective_costs
from .simulate import simulate
from .strategies import checkpoint_all, keep_all


def make_plan(costs: ChainCosts, budget: int | None, config: FitConfig, *,
              tier: str = "ram") -> Plan:
    """The plan for ``costs`` under ``budget`` bytes of the compute tier (None: unlimited).

    Raises BudgetError naming the smallest budget that works when nothing fits. The taped
    forwards of the stages the costs price as selective run selectively.
    """
    keep = keep_all(costs)
    keep_peak = simulate(costs, keep).peak
    if budget is None:
        ops = checkpoint_all(costs) if config.planner == "checkpoint-all" else keep
        return Plan(config.planner if config.planner != "auto" else "keep-all",
                    _marked(costs, ops), costs, None, ("no budget was given, so nothing needs to be recomputed",)
                    if ops is keep else ())
    usable = int(budget * (1.0 - config.headroom)) - costs.static_bytes
    if config.planner in ("keep-all", "checkpoint-all"):
        ops = keep if config.planner == "keep-all" else checkpoint_all(costs)
        peak = simulate(costs, ops).peak
        if peak > usable:
            least = budget_for(costs, smallest_budget(costs), config)
            _raise(tier, budget, costs, peak, config,
                   hint=f"or use planner='rotor', which needs at least "
                        f"{format_bytes(least, round_up=True)}")
        return Plan(config.planner, _marked(costs, ops), costs, budget,
                    (f"planner '{config.planner}' was asked for",))
    if config.planner == "auto" and keep_peak <= usable:
        return Plan("keep-all", _marked(costs, keep), costs, budget,
                    (f"keeping every activation needs {format_bytes(keep_peak)}, within the "
                     f"{format_bytes(usable)} left for activations",))
    try:
        ops = rotor(costs, max(usable, 0), slots=config.rotor_slots)
    except Infeasible as e:
        _raise(tier, budget, costs, e.smallest, config)
    sim = simulate(costs, ops)
    base = simulate(costs, keep).time
    return Plan("rotor", _marked(costs, ops), costs, budget,
                (f"keeping every activation would need {format_bytes(keep_peak)} but "
                 f"{format_bytes(max(usable, 0))} is left for activations after "
                 f"{format_bytes(costs.static_bytes)} of parameters and optimizer states; rotor "
                 f"recomputes what costs the least time per byte saved "
                 f"(+{(sim.time / base - 1) * 100:.0f}% time for "
                 f"{format_bytes(keep_peak - sim.peak)} less memory)",))


def fastest_plan(costs: ChainCosts, budget: int | None, config: FitConfig, *,
                 tier: str = "ram") -> Plan:
    """``make_plan`` of ``costs`` and of their selective variant (every stage that has one
    runs selectively), as ``config.selective`` allows: the faster that fits; the whole
    tapes' plan on a tie. The BudgetError of the one that came closer if neither fits."""
    stages = selectable(costs)
    variants = [costs] if config.selective != "all" or not stages else []
    if config.selective != "never" and stages:
        variants.append(selective_costs(costs, stages))
    plans, errors = [], []
    for variant in variants:
        try:
            plans.append(make_plan(variant, budget, config, tier=tier))
        except BudgetError as e:
            errors.append(e)
    if not plans:
        raise min(errors, key=lambda e: e.smallest)
    return min(plans, key=lambda plan: plan.predicted_time)


def budget_for(costs: ChainCosts, activations: int, config: FitConfig) -> int:
    """The tier budget needed for a given activation peak, headroom included."""
    return int((costs.static_bytes + activations) / (1.0 - config.headroom)) + 1


def _marked(costs: ChainCosts, ops: list) -> tuple:
    """``ops`` with the taped forwards of the stages ``costs`` price as selective marked so."""
    return mark_selective(ops, set(costs.selective))


def _raise(tier: str, budget: int, costs: ChainCosts, activations: int, config: FitConfig,
           hint: str = "") -> None:
    smallest = budget_for(costs, activations, config)
    at_least = format_bytes(smallest, round_up=True)
    raise BudgetError(
        f"{tier} budget {format_bytes(budget)} is below the smallest that works, {at_least} "
        f"({format_bytes(costs.static_bytes)} static: parameters, optimizer states, runtime; "
        f"+ {format_bytes(activations)} activations and gradients): raise {tier} to at least "
        f"{at_least}" + (f", {hint}" if hint else ""),
        tier=tier, budget=budget, smallest=smallest)
