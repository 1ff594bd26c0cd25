"""What the collectives of one step cost: the bus bandwidth of the default process group,
measured once at start, and the step's predicted communication time.

Bus bandwidth is NCCL-tests' convention: a ring all-reduce of ``b`` bytes over ``N`` ranks
moves ``2 (N - 1) / N * b`` bytes through each rank's link, so ``bus = that / seconds``. A
step reduce-scatters the gradients (``(N - 1) / N * b`` each way) and all-gathers the
parameters (the same), so it moves ``(N - 1) / N * (gradient bytes + parameter bytes)``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .world import World

PROBE_BYTES = 8 << 20  # big enough to leave latency behind on gloo, cheap (a few ms)


def bus_bandwidth(world: World, device: torch.device, nbytes: int = PROBE_BYTES,
                  rounds: int = 3) -> float:
    """Bytes per second through each rank's link in an all-reduce of ``nbytes`` (the best
    of ``rounds``, after one warm-up); every rank gets rank 0's figure."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # (nbytes / 4,)
    best = float("inf")
    with world.collective("bandwidth probe"):
        for i in range(rounds + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - t0)
        bus = torch.tensor([2 * (world.size - 1) / world.size * nbytes / best],
                           dtype=torch.float64, device=device)
        dist.broadcast(bus, src=0)
    return float(bus)


def step_seconds(world_size: int, grad_bytes: int, param_bytes: int, bus: float) -> float:
    """Predicted seconds of one step's gradient reduce-scatter and parameter all-gather."""
    return (world_size - 1) / world_size * (grad_bytes + param_bytes) / bus
