"""What ``tierflow plan`` reports of a plan, pure data: where weights, gradients and optimizer
states live (a ``KindPlacement`` each), how activations are held, the peak and budget of
each tier, each resource's busy seconds, the step time and what bounds it (a
``Placement``), or, when nothing fits, the ``PlacementError`` that names the smallest
budget of each tier. ``sim/tiered.py`` makes it from the plan the trainer's own search
(``plan/tier_search.py``) chooses.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..core.errors import BudgetError
from ..core.units import format_bytes

KINDS = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class KindPlacement:
    resident: int  # the first `resident` stages live on the compute tier
    home: str  # where the other stages live
    below: tuple[int, ...] | None = None  # which stages live in `home`, when not the last ones


@dataclass(frozen=True)
class Placement:
    compute_tier: str
    stages: int
    weights: KindPlacement
    grads: KindPlacement
    optimizer: KindPlacement
    activations: str  # keep, recompute, offload, offload+recompute
    recomputed: int  # stages whose forward is recomputed
    prefetch: int
    peaks: dict[str, int]  # predicted peak per tier, bytes
    budgets: dict[str, int | None]
    times: dict[str, float]  # seconds per step each resource is busy
    step_time: float
    bottleneck: str
    smallest: dict[str, int | None]  # per tier, the smallest budget that works with the others
    notes: tuple[str, ...] = field(default_factory=tuple)
    selective: int = 0  # stages whose taped forwards keep only matmul and attention outputs
    decisions: dict = field(default_factory=dict)  # the plan's own (``Plan.decisions``)

    def to_json(self) -> str:
        return json.dumps({"format": "tierflow-placement", **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Placement:
        data = json.loads(text)
        if data.pop("format", None) != "tierflow-placement":
            raise ValueError("not a tierflow placement (format: tierflow-placement)")
        for kind in KINDS:
            below = data[kind].pop("below", None)
            data[kind] = KindPlacement(**data[kind],
                                       below=None if below is None else tuple(below))
        data["notes"] = tuple(data["notes"])
        return cls(**data)

    def describe(self, kind: str) -> str:
        """Where ``kind`` lives, in words."""
        k: KindPlacement = getattr(self, kind)
        if k.resident >= self.stages:
            return f"all on {self.compute_tier}"
        if k.resident == 0:
            return f"all on {k.home}" + (", streamed" if kind == "weights" else "")
        if k.below is not None:
            return f"{len(k.below)} of {self.stages} stages on {k.home} (stages " \
                   f"{', '.join(map(str, k.below))}), the rest on {self.compute_tier}"
        return f"first {k.resident} of {self.stages} stages on {self.compute_tier}, the rest " \
               f"on {k.home}"


class PlacementError(BudgetError):
    """No placement fits; ``smallest`` maps each tier to its smallest workable budget."""

    def __init__(self, message: str, smallest: dict[str, int | None], tier: str, budget: int):
        super().__init__(message, tier=tier, budget=budget, smallest=smallest.get(tier) or 0)
        self.smallest_per_tier = smallest


def infeasible_error(budgets: dict[str, int | None], smallest: dict[str, int | None],
                     floors: dict[str, int]) -> PlacementError:
    """The one-line error naming, per tier, the smallest budget that works with the others
    (``smallest``; None: none does) or, failing that, what the other tiers would need
    whatever this one is (``floors``)."""
    limited = [t for t, b in budgets.items() if b is not None]
    parts = []
    for tier in limited:
        others = ", ".join(f"{t} {format_bytes(budgets[t])}" for t in limited if t != tier)
        with_others = f" with {others}" if others else ""
        if smallest[tier] is not None:
            parts.append(f"{tier} needs at least {format_bytes(smallest[tier], round_up=True)}"
                         f"{with_others}")
            continue
        short = [f"{t} at least {format_bytes(floors[t], round_up=True)}" for t in limited
                 if t != tier and floors[t] > budgets[t]]
        parts.append(f"no {tier} budget works{with_others}"
                     + (f" (whatever {tier} is, it takes {', '.join(short)})" if short else ""))
    given = ", ".join(f"{t} {format_bytes(budgets[t])}" for t in limited)
    worst = next((t for t in limited if smallest[t] is not None), limited[0])
    return PlacementError(f"nothing fits {given}: " + "; ".join(parts) + ": raise one of them",
                          smallest, worst, budgets[worst] or 0)
