"""What ZeRO-2's parameter all-gather after the optimizer step costs (the gradient
reductions are the plan's Reduce ops, priced there: ``plan/reductions.py``), at the bus
bandwidth measured once at start (``profile/machine.bus_bandwidth``).

Bus bandwidth is NCCL-tests' convention: a ring all-reduce of ``b`` bytes over ``N`` ranks
moves ``2 (N - 1) / N * b`` bytes through each rank's link, so ``bus = that / seconds``. An
all-gather of ``b`` bytes moves ``(N - 1) / N * b``.
"""
from __future__ import annotations


def gather_seconds(world_size: int, param_bytes: int, bus: float) -> float:
    """Predicted seconds of the all-gather of ``param_bytes`` of parameters."""
    return (world_size - 1) / world_size * param_bytes / bus
