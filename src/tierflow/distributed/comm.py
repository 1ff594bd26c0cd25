"""What the collectives of one step cost: the step's predicted communication time at the
bus bandwidth measured once at start (``profile/machine.bus_bandwidth``).

Bus bandwidth is NCCL-tests' convention: a ring all-reduce of ``b`` bytes over ``N`` ranks
moves ``2 (N - 1) / N * b`` bytes through each rank's link, so ``bus = that / seconds``. A
step reduce-scatters the gradients (``(N - 1) / N * b`` each way) and all-gathers the
parameters (the same), so it moves ``(N - 1) / N * (gradient bytes + parameter bytes)``.
"""
from __future__ import annotations


def step_seconds(world_size: int, grad_bytes: int, param_bytes: int, bus: float) -> float:
    """Predicted seconds of one step's gradient reduce-scatter and parameter all-gather."""
    return (world_size - 1) / world_size * (grad_bytes + param_bytes) / bus
