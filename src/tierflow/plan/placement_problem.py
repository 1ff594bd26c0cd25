"""The placement planner's question and answer, pure data: a ``Problem`` (the stages'
parameters and times, the tiers with their budgets, the links between them, the ways to hold
the activations) and the ``Placement`` chosen for it, or the ``PlacementError`` that names
the smallest budget of each tier when none fits. ``plan/placement.py`` searches.

Tiers are ordered from the compute tier down (``gpu, ram, disk``; on a machine without a
GPU ``ram, disk``); link ``l`` joins tier ``l`` and ``l + 1``. An executor reads a
``Placement`` as: stage i's weights live on ``compute_tier`` if i < weights.resident else on
weights.home (same for gradients and optimizer); activation mode and rotor budget as
stated; ``prefetch`` weight buffers ahead.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import BudgetError
from ..units import format_bytes

KINDS = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind (a mixed-precision AdamW: 2, 2, 4, 8)."""

    weights: float
    grads: float
    master: float  # an fp32 copy beside low-precision weights; 0 when the weights are fp32
    moments: float  # both AdamW moments together

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.moments

    @property
    def states(self) -> float:
        """What the optimizer keeps between steps: master + moments."""
        return self.master + self.moments

    @property
    def update_traffic(self) -> float:
        """Bytes of memory traffic per parameter of one AdamW update: read the gradient
        (twice, with the norm clip), read and write the states, write the weights."""
        return self.weights + 2 * self.grads + 2 * self.states


@dataclass(frozen=True)
class Tier:
    name: str  # "gpu", "ram", "disk"
    budget: int | None  # bytes; None: unlimited


@dataclass(frozen=True)
class Link:
    """Bandwidths (bytes/s) between tier ``l`` and ``l + 1``: ``up`` toward compute."""

    up: float
    down: float


@dataclass(frozen=True)
class ActivationOption:
    """One way to hold a micro-batch's activations on the compute tier: its peak (bytes,
    activations + transients, gradients included when ``with_grads``), the chain's compute
    time with it (seconds) and what it recomputes. ``offload``: boundaries go to tier 1."""

    mode: str  # "keep", "recompute", "offload" (tapes) or "offload+recompute" (boundaries)
    peak: int
    time: float
    recomputed: int = 0  # stages whose forward runs again
    with_grads: bool = False  # the peak counts the parameter gradients as they appear
    offload_bytes: int = 0  # per micro-batch, to tier 1 and back


@dataclass(frozen=True)
class Problem:
    params: tuple[int, ...]  # parameters per stage (its weights)
    compute: tuple[float, ...]  # forward + backward seconds per stage and micro-batch
    precision: Precision
    tiers: tuple[Tier, ...]  # compute tier first
    links: tuple[Link, ...]  # len(tiers) - 1
    activations: tuple[ActivationOption, ...]
    grad_accum: int = 1
    host_update_bw: float = 10e9  # bytes/s of memory traffic of the host (CPU) optimizer
    device_update_bw: float = 10e9  # same on the compute tier
    runtime_bytes: int = 0  # static on the compute tier
    # per stage, the parameters that train (gradients, optimizer states, updates); empty:
    # all of them. A partial fine-tune's frozen weights are only read.
    trainable: tuple[int, ...] = ()
    forward_only: int = 0  # stages at the front without a backward: weights fetched once

    @property
    def host(self) -> int:
        """Index of the tier where the host optimizer runs (RAM)."""
        return 0 if self.tiers[0].name != "gpu" else 1


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
