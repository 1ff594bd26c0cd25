"""Gradient reduction stage by stage, overlapped with the rest of backward.

tierflow's executor runs backward one stage at a time, and ``.grad`` accumulates as usual, so
a hook after each gradient accumulation (``register_post_accumulate_grad_hook``) can tell when
the last of a stage's parameters is done. Then, on the last micro-batch of a step only (the
others accumulate locally, like DDP's ``no_sync``), the stage's gradients are packed into one
flat bucket, freed, and reduce-scattered asynchronously: the backward of the stages before it
runs while gloo or NCCL moves the bytes. Each rank keeps only its shard of the reduced
gradient (ZeRO-2); the full gradients never exist again on any rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import ShardLayout
from .world import World


class GradReducer:
    """Hooks on every trainable parameter; ``finish()`` returns each stage's reduced shard."""

    def __init__(self, layout: ShardLayout, world: World):
        self.layout = layout
        self.world = world
        self.sync = False  # set for the last micro-batch of a step
        self._got_grad: set[int] = set()  # id(param) of those with a gradient this step
        self._arrivals: dict[int, int] = {}
        self._left = [len(stage.params) for stage in layout.stages]
        self._inflight: dict[int, tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}
        for p in layout.order:
            p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        key = id(p)
        self._arrivals[key] = self._arrivals.get(key, 0) + 1
        if self._arrivals[key] == self.layout.uses[key]:
            stage = self.layout.stage_of[key]
            self._left[stage] -= 1
            if self._left[stage] == 0:
                self._launch(stage)

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
        """Start the stages whose gradients never all arrived (a parameter without a
        gradient), wait for every reduction; returns this rank's shard of each stage's
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
        self._arrivals.clear()
        self._left = [len(stage.params) for stage in self.layout.stages]
        self.sync = False
        got, self._got_grad = self._got_grad, set()
        return shards, got
