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
for the plan's routine after the optimizer's step. Each step the ranks also exchange a few
values (``exchanges``): the loss, under ZeRO-2 the shards' squared gradient norms, and the
memory report, each an all-gather of 8-byte values (the trainer's: a caller of ``fit``
names its own or none).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import ChainCosts
from .ops import Backward, Exchange, Gather, Op, Reduce

NETWORK = "network"  # the resource of the collectives between the ranks
# the values the ranks exchange each step (an Exchange's ``what``), and how many per rank
LOSS, GRADIENT_NORM, MEMORY_REPORT = "loss", "gradient norm", "memory report"
VALUES = {LOSS: 1, GRADIENT_NORM: 1, MEMORY_REPORT: 3}  # report: peak RSS, state bytes, a flag
VALUE_BYTES = 8  # each a float64


@dataclass(frozen=True)
class Reductions:
    """``ranks`` workers, each stage's gradients all-reduced (``all_reduce``: every rank
    keeps the whole mean, as replicas do) or reduce-scattered (each keeps its shard: ZeRO-2),
    over a link of ``bus`` bytes/s (bus bandwidth); ``exchanged``: the values the ranks
    exchange each step (``step_values``: the trainer's; none for a caller of ``fit`` who
    reports nothing across the ranks)."""

    ranks: int
    all_reduce: bool
    bus: float
    exchanged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"Reductions: ranks={self.ranks} must be >= 1")
        if self.bus <= 0:
            raise ValueError(f"Reductions: bus={self.bus} bytes/s must be > 0")
        unknown = [what for what in self.exchanged if what not in VALUES]
        if unknown:
            raise ValueError(f"Reductions: exchanged values {unknown} are not among "
                             f"{sorted(VALUES)}")

    def link_bytes(self, grad_bytes: int) -> int:
        """Bytes through each rank's link to reduce ``grad_bytes`` of gradients."""
        passes = 2 if self.all_reduce else 1
        return passes * (self.ranks - 1) * grad_bytes // self.ranks

    def gather_bytes(self, param_bytes: int) -> int:
        """Bytes through each rank's link to all-gather ``param_bytes`` of parameters."""
        return (self.ranks - 1) * param_bytes // self.ranks

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "all_reduce": self.all_reduce, "bus": self.bus,
                "exchanged": list(self.exchanged)}

    @classmethod
    def from_dict(cls, data: dict) -> "Reductions":
        return cls(int(data["ranks"]), bool(data["all_reduce"]), float(data["bus"]),
                   tuple(str(what) for what in data.get("exchanged", ())))


def step_values(all_reduce: bool) -> tuple[str, ...]:
    """What the trainer's ranks exchange each step, in its order: the loss (its mean over the
    ranks) after the backward; under ZeRO-2 (not ``all_reduce``) each shard's squared
    gradient norm, whose sum clips every shard (replicas hold whole averaged gradients and
    measure the norm alone); after the step, the memory report (each rank's peak RSS, its
    state bytes, whether it was interrupted)."""
    return (LOSS, *(() if all_reduce else (GRADIENT_NORM,)), MEMORY_REPORT)


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


def exchanges(reductions: Reductions) -> tuple[Exchange, ...]:
    """An Exchange of each of ``reductions.exchanged``, in that order, priced as an
    all-gather of its 8-byte values."""
    return tuple(Exchange(what, NETWORK,
                          reductions.gather_bytes(reductions.ranks * VALUES[what] * VALUE_BYTES))
                 for what in reductions.exchanged)


def trained_bytes(ops: Sequence[Op], costs: ChainCosts) -> dict[int, int]:
    """Per stage with a backward in ``ops`` that owns trainable parameters, their bytes (the
    lowest such stage, whose backward runs last, owns the shared ones as well)."""
    stages = sorted({op.stage for op in ops if isinstance(op, Backward)})
    owned = {i: costs.stages[i].param_bytes for i in stages}
    if stages:
        owned[stages[0]] += costs.shared_grad_bytes
    return {i: n for i, n in owned.items() if n}
