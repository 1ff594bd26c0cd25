"""What a plan moves between tiers: the weights of its streamed stages, the optimizer states
that live below the compute tier, the tapes it keeps there between a stage's forward and
its backward, the checkpoints it stashes there, the gradients of its streamed stages between
micro-batches, and whether its updates run inside the backward or in a pass after it.
``Plan.with_transfers`` places their ops.

Pure data.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kept_below import KeptBelow
from .reductions import Reductions
from .weight_schedule import StreamedWeights


@dataclass(frozen=True)
class Transfers:
    """``update_order``: the stages the update pass after the backward steps, in its order
    (deferred updates: gradient accumulation, clipping); None when each
    stage is updated inside the backward. ``gradients``: the streamed stages' gradients
    kept below between a backward and their next use (deferred updates), read back before
    each backward when ``accumulates`` (over micro-batches). ``host_stages``: the stages the
    optimizer steps in host RAM: their Updates name the host optimizer (inside the
    backward, or first in the update pass when deferred). ``host_gradients``: the gradients
    of those of them that the plan copies down from the compute tier to the host RAM for
    their step (``home``: that RAM), each stored after its backward (inside the backward)
    or right before its Update (deferred; a stage whose gradients wait below already, in
    ``gradients``, has none). ``reductions``: data parallelism, each stage's gradients
    reduced over the ranks (``plan/reductions.py``; None: one worker)."""

    weights: StreamedWeights | None = None
    states: KeptBelow | None = None
    update_order: tuple[int, ...] | None = None
    tapes: KeptBelow | None = None
    boundaries: KeptBelow | None = None
    gradients: KeptBelow | None = None
    accumulates: bool = False
    host_stages: frozenset[int] = frozenset()
    host_gradients: KeptBelow | None = None
    reductions: Reductions | None = None

    @property
    def deferred(self) -> bool:
        return self.update_order is not None

    def to_dict(self) -> dict:
        return {"weights": self.weights.to_dict() if self.weights else None,
                "states": self.states.to_dict() if self.states else None,
                "update_order": None if self.update_order is None else list(self.update_order),
                "tapes": self.tapes.to_dict() if self.tapes else None,
                "boundaries": self.boundaries.to_dict() if self.boundaries else None,
                "gradients": self.gradients.to_dict() if self.gradients else None,
                "accumulates": self.accumulates,
                "host_stages": sorted(self.host_stages),
                "host_gradients": self.host_gradients.to_dict() if self.host_gradients
                else None,
                "reductions": self.reductions.to_dict() if self.reductions else None}

    @classmethod
    def from_dict(cls, data: dict) -> "Transfers":
        order = data["update_order"]
        return cls(weights=StreamedWeights.from_dict(data["weights"]) if data["weights"] else None,
                   states=KeptBelow.from_dict(data["states"]) if data["states"] else None,
                   update_order=None if order is None else tuple(order),
                   tapes=KeptBelow.from_dict(data["tapes"]) if data["tapes"] else None,
                   boundaries=KeptBelow.from_dict(data["boundaries"])
                   if data["boundaries"] else None,
                   gradients=KeptBelow.from_dict(data["gradients"])
                   if data["gradients"] else None,
                   accumulates=bool(data["accumulates"]),
                   host_stages=frozenset(int(i) for i in data["host_stages"]),
                   host_gradients=KeptBelow.from_dict(data["host_gradients"])
                   if data["host_gradients"] else None,
                   reductions=Reductions.from_dict(data["reductions"])
                   if data.get("reductions") else None)
