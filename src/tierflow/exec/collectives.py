"""What runs a plan's collectives between data-parallel ranks: its ``Reduce`` ops (each
stage's gradients, right after the stage's backward), its ``Gather`` ops (ZeRO-2's
updated shards, after the optimizer's step) and its ``Exchange`` ops (a step's few values:
``TierflowModule.exchange``). The trainer's sharded optimizer is one
(``distributed.ShardedOptimizer``); ``TierflowModule.reduce_gradients_with`` makes one for
replicas that average their gradients."""
from __future__ import annotations

from typing import Protocol


class Collectives(Protocol):
    def reduce_stage(self, stage: int) -> None:
        """The plan's Reduce(stage): start (or do) reducing the stage's gradients over the
        ranks in the step's last micro-batch; nothing in the others."""

    def gather_stage(self, stage: int) -> None:
        """The plan's Gather(stage): start all-gathering the stage's updated shards."""

    def wait_gathered(self) -> None:
        """Return once every gather started has arrived."""

    def exchange(self, values: list[float], what: str) -> list[list[float]]:
        """The plan's Exchange(what): every rank's ``values`` (a few numbers), by rank."""
