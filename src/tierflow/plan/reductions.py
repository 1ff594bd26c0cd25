"""Data parallelism in the plan: where each stage's gradient reduction over the ranks runs,
where ZeRO-2's parameter all-gathers run, and what they cost. Pure data.

A stage's gradients are complete for a step after its Backward in the last micro-batch (a
parameter several stages use belongs to the first of them, whose backward runs last), so
``with_reductions`` puts one ``Reduce`` right after each Backward of a stage with trainable
parameters: the backward of the stages below runs while the network moves its bytes, and
the stage's Update or the Store of its gradients, placed after it, waits for it
(``plan/timeline.py``). The bytes follow NCCL-tests' bus convention: a ring all-reduce of
``b`` bytes over ``N`` ranks moves ``2 (N - 1) / N * b`` through each rank's link, a
reduce-scatter or an all-gather half that; ``bus`` is the measured bus bandwidth
(``profile/machine.bus_bandwidth``). Under ZeRO-2 each rank steps only its shard, so
``gathers`` lists one ``Gather`` per such stage, in stage order (the next forward's first),
for the plan's routine after the optimizer's step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import ChainCosts
from .ops import Backward, Gather, Op, Reduce

NETWORK = "network"  # the resource of the collectives between the ranks


@dataclass(frozen=True)
class Reductions:
    """``ranks`` workers, each stage's gradients all-reduced (``all_reduce``: every rank
    keeps the whole mean, as replicas do) or reduce-scattered (each keeps its shard: ZeRO-2),
    over a link of ``bus`` bytes/s (bus bandwidth)."""

    ranks: int
    all_reduce: bool
    bus: float

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"Reductions: ranks={self.ranks} must be >= 1")
        if self.bus <= 0:
            raise ValueError(f"Reductions: bus={self.bus} bytes/s must be > 0")

    def link_bytes(self, grad_bytes: int) -> int:
        """Bytes through each rank's link to reduce ``grad_bytes`` of gradients."""
        passes = 2 if self.all_reduce else 1
        return passes * (self.ranks - 1) * grad_bytes // self.ranks

    def gather_bytes(self, param_bytes: int) -> int:
        """Bytes through each rank's link to all-gather ``param_bytes`` of parameters."""
        return (self.ranks - 1) * param_bytes // self.ranks

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "all_reduce": self.all_reduce, "bus": self.bus}

    @classmethod
    def from_dict(cls, data: dict) -> "Reductions":
        return cls(int(data["ranks"]), bool(data["all_reduce"]), float(data["bus"]))


def with_reductions(ops: Sequence[Op], costs: ChainCosts,
                    reductions: Reductions) -> tuple[Op, ...]:
    """``ops`` with a Reduce right after each Backward of a stage that owns trainable
    parameters."""
    trained = trained_bytes(ops, costs)
    placed: list[Op] = []
    for op in ops:
        placed.append(op)
        if isinstance(op, Backward) and op.stage in trained:
            nbytes = reductions.link_bytes(trained[op.stage])
            placed.append(Reduce(op.stage, NETWORK, nbytes))
    return tuple(placed)


def gathers(ops: Sequence[Op], costs: ChainCosts, reductions: Reductions) -> tuple[Op, ...]:
    """ZeRO-2's routine after the optimizer's step: a Gather of each stage that owns
    trainable parameters, in stage order (none when every rank holds whole replicas)."""
    if reductions.all_reduce:
        return ()
    trained = trained_bytes(ops, costs)
    return tuple(Gather(i, NETWORK, reductions.gather_bytes(trained[i])) for i in sorted(trained))


def trained_bytes(ops: Sequence[Op], costs: ChainCosts) -> dict[int, int]:
    """Per stage with a backward in ``ops`` that owns trainable parameters, their bytes (the
    lowest such stage, whose backward runs last, owns the shared ones as well)."""
    stages = sorted({op.stage for op in ops if isinstance(op, Backward)})
    owned = {i: costs.stages[i].param_bytes for i in stages}
    if stages:
        owned[stages[0]] += costs.shared_grad_bytes
    return {i: n for i, n in owned.items() if n}
