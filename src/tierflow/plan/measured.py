"""What a run measured before it planned: the planner's inputs that come from this machine
rather than from the model's shape, as one record that ``fit`` hands back, the trainer keeps
(``profile/kept_profiles.py``) and ``tierflow plan --measure`` plans on.

Pure data, JSON both ways (never pickled). Planning twice on the same record with the same
budgets and config makes the same plan: that is how the plan `tierflow plan --measure`
prints after a run of `tierflow train` is the plan that run ran, not a near tie re-measured.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .costs import ChainCosts
from .tier_candidates import UpdateRates


@dataclass(frozen=True)
class Measured:
    """The chain's costs for each LM-head chunk (tokens) that was profiled, the optimizer's
    update rates, the disk tier's (read, write) bytes/s where there was one, and ``held``:
    bytes of the RAM budget the process held outside the plan (the trainer plans with its
    budget less these)."""

    costs: dict[int, ChainCosts]
    rates: UpdateRates
    disk_rates: tuple[float, float] | None = None
    held: int = 0
    # who measured it, in words, where a run kept it (not written: its file says); "": a
    # one-layer copy that `tierflow plan --measure` ran just now
    origin: str = ""

    def to_dict(self) -> dict:
        return {"costs": {str(chunk): costs.to_dict() for chunk, costs in self.costs.items()},
                "rates": asdict(self.rates),
                "disk_rates": list(self.disk_rates) if self.disk_rates else None,
                "held": self.held}

    @classmethod
    def from_dict(cls, data: dict) -> Measured:
        """The record ``to_dict`` wrote; KeyError or TypeError where ``data`` is not one."""
        disk = data.get("disk_rates")
        return cls(costs={int(chunk): ChainCosts.from_dict(costs)
                          for chunk, costs in data["costs"].items()},
                   rates=UpdateRates(**data["rates"]),
                   disk_rates=(float(disk[0]), float(disk[1])) if disk else None,
                   held=int(data.get("held", 0)))
