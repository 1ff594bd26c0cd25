"""Gradient reduction stage by stage, overlapped with the rest of backward.

The plan puts a ``Reduce(i)`` op right after each stage's backward (``plan/reductions.py``);
the module calls ``reduce_stage(i)`` when it runs. On the last micro-batch of a step only
(the others accumulate locally, like DDP's ``no_sync``), the stage's gradients are packed into
one flat bucket, freed, and reduce-scattered asynchronously: the backward of the stages before
it runs while gloo or NCCL moves the bytes. Each rank keeps only its shard of the reduced
gradient (ZeRO-2); the full gradients never exist again on any rank. A parameter several
stages use belongs to the first of them (``layout.py``), whose backward runs last.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import ShardLayout
from .world import World


class GradReducer:
    """Each stage's reduce-scatter, started by ``reduce_stage``; ``finish()`` returns each
    stage's reduced shard."""

    def __init__(self, layout: ShardLayout, world: World):
        self.layout = layout
        self.world = world
        self.sync = False  # set for the last micro-batch of a step
        self._got_grad: set[int] = set()  # id(param) of those with a gradient this step
        self._inflight: dict[int, tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}

    def reduce_stage(self, s: int) -> None:
        """The plan's Reduce(s): start stage ``s``'s reduction on the step's last
        micro-batch."""
        if self.sync and self.layout.stages[s].numel:
            self._launch(s)

    def _launch(self, s: int) -> None:
        """Pack stage ``s``'s gradients (freeing them) and start their reduce-scatter."""
        stage = self.layout.stages[s]
        dtype = self.layout.order[0].dtype
        device = self.layout.order[0].device
        bucket = torch.zeros(stage.padded, dtype=dtype, device=device)  # (world * shard,)
        for p, off in zip(stage.params, stage.offsets):
            if p.grad is not None:
                bucket[off:off + p.numel()].copy_(p.grad.reshape(-1))
                self._got_grad.add(id(p))
                p.grad = None
        bucket.div_(self.world.size)  # the sum of the ranks' means, over N: the global mean
        shard = torch.empty(stage.shard, dtype=dtype, device=device)  # (shard,)
        with self.world.collective("gradient reduction"):
            work = dist.reduce_scatter_single(shard, bucket, async_op=True)
        self._inflight[s] = (work, bucket, shard)

    def finish(self) -> tuple[list[torch.Tensor], set[int]]:
        """Start the stages whose Reduce did not run (none when the plan has a Reduce for
        every stage with parameters, as placed), wait for every reduction; returns this rank's shard of each stage's
        reduced gradient, ``(shard,)`` per stage, and the ids of the parameters that had a
        gradient on this rank."""
        stages = self.layout.stages
        for s, stage in enumerate(stages):
            if s not in self._inflight and stage.numel:
                self._launch(s)
        shards = []
        with self.world.collective("gradient reduction"):
            for s, stage in enumerate(stages):
                if not stage.numel:  # a stage without parameters of its own
                    shards.append(torch.empty(0, dtype=self.layout.order[0].dtype))
                    continue
                work, _bucket, shard = self._inflight.pop(s)
                work.wait()
                shards.append(shard)
        self.sync = False
        got, self._got_grad = self._got_grad, set()
        return shards, got
