"""ZeRO-2 over the default process group: each rank updates only its shard of the parameters.
It runs the plan's collectives (``exec/collectives.Collectives``): each stage's Reduce, each
stage's Gather after the step, and the step's Exchanges.

The optimizer is any ``torch.optim.Optimizer`` whose update is element-wise (AdamW), built by
the caller's factory over *pieces*: one-dimensional aliases of the parts of the parameters that
fall in this rank's shards (``layout.py``). Its states (the AdamW moments) therefore exist
for 1/N of the elements on each rank, and the update writes straight into the model's
parameters (the pieces share their storage: the fp32 weights are their own master copy).
After the update each stage's shards are all-gathered so that every rank holds the whole,
updated model again (the plan's Gather ops, in stage order). The global gradient norm is the
square root of the sum over ranks of each shard's sum of squares (the plan's Exchange of the
gradient norm).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan.reductions import GRADIENT_NORM
from .layout import ShardLayout, StageShard
from .reducer import GradReducer
from .state import gather_state, scatter_state
from .world import World

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class ShardedOptimizer:
    """Data parallel training with sharded optimizer states and gradients.

    ``groups`` are torch param groups of full parameters (``{"params": [...], ...}``);
    ``make`` builds the optimizer from the same groups with this rank's pieces in place of
    the parameters (it is the single-process factory, unchanged); ``plan_exchange(what,
    values)`` runs the plan's Exchange of ``what`` (``TierflowModule.exchange``, which hands
    it back to ``exchange`` here): the clipping norm's."""

    def __init__(self, world: World, stage_params: Sequence[Sequence[nn.Parameter]],
                 groups: Sequence[dict[str, Any]], make: OptimizerFactory,
                 plan_exchange: Callable[[str, list[float]], list[list[float]]]):
        self.world = world
        self.plan_exchange = plan_exchange
        self.layout = ShardLayout(stage_params, [g["params"] for g in groups], world.rank,
                                  world.size)
        with world.collective("parameter broadcast"), torch.no_grad():
            for p in self.layout.order:  # every rank starts from rank 0's weights
                dist.broadcast(p, src=0)
        self.pieces = self.layout.pieces()
        self.views = [nn.Parameter(piece.param.detach().view(-1)[piece.start:piece.stop])
                      for piece in self.pieces]  # aliases of the model's storage
        by_group: list[list[nn.Parameter]] = [[] for _ in groups]
        for piece, view in zip(self.pieces, self.views):
            by_group[piece.group].append(view)
        self.optimizer = make([{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                               for g, ps in zip(groups, by_group)])
        self.reducer = GradReducer(self.layout, world)
        self._gathering: tuple[StageShard, dist.Work, torch.Tensor] | None = None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def micro_batch(self, last: bool) -> None:
        """Before a micro-batch's backward: reduce the gradients only after the last one."""
        self.reducer.sync = last

    def reduce_stage(self, s: int) -> None:
        """The plan's Reduce(s) (``TierflowModule.run_collectives_with``): start reducing
        stage ``s``'s gradients, on the step's last micro-batch."""
        self.reducer.reduce_stage(s)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Wait for the reductions, clip every shard by the global norm, return the norm
        (``torch.nn.utils.clip_grad_norm_``'s rule: scale by max_norm / (norm + 1e-6) when
        that is below 1)."""
        shards, got = self.reducer.finish()
        for piece, view in zip(self.pieces, self.views):
            grad = shards[self.layout.stage_of[id(piece.param)]]
            view.grad = (grad[piece.offset:piece.offset + piece.numel]
                         if id(piece.param) in got else None)
        squares = sum(float(torch.dot(s.double(), s.double())) for s in shards)
        by_rank = self.plan_exchange(GRADIENT_NORM, [squares])  # the same sum on every rank
        norm = math.sqrt(sum(row[0] for row in by_rank))
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for shard in shards:
                shard.mul_(coef)
        return norm

    def exchange(self, values: list[float], what: str) -> list[list[float]]:
        """The plan's Exchange(what) (``Collectives``): every rank's ``values``, by rank."""
        return self.world.all_gather(values, what)

    def step(self) -> None:
        """Update this rank's pieces (the plan's gathers then bring every rank the others':
        ``TierflowModule.gather_parameters``)."""
        self.optimizer.step()
        self.zero_grad()

    def gather_stage(self, s: int) -> None:
        """The plan's Gather(s): start all-gathering stage ``s``'s updated shards, and
        unpack the one before it meanwhile."""
        stage = self.layout.stages[s]
        if stage.numel == 0:
            return
        with self.world.collective("parameter all-gather"):
            launched = self._start_gather(stage)
            if self._gathering is not None:
                _unpack(*self._gathering)
        self._gathering = launched

    def wait_gathered(self) -> None:
        """Unpack the last gather started (the others were, as the next one started)."""
        if self._gathering is not None:
            with self.world.collective("parameter all-gather"):
                _unpack(*self._gathering)
            self._gathering = None

    def _start_gather(self, stage: StageShard) -> tuple[StageShard, dist.Work, torch.Tensor]:
        first = stage.params[0]
        mine = torch.zeros(stage.shard, dtype=first.dtype, device=first.device)  # (shard,)
        for piece in stage.pieces:
            mine[piece.offset:piece.offset + piece.numel] = \
                piece.param.detach().view(-1)[piece.start:piece.stop]
        full = torch.empty(stage.padded, dtype=first.dtype, device=first.device)  # (N * shard,)
        return stage, dist.all_gather_single(full, mine, async_op=True), full

    def zero_grad(self) -> None:
        for view in self.views:
            view.grad = None

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer states (the AdamW moments and step counters)."""
        return sum(t.nbytes for state in self.optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor))

    def state_dict(self) -> dict | None:
        """The whole optimizer state, as a single-process optimizer's ``state_dict()`` over
        the full parameters, on rank 0 (None on the others). Every rank must call it."""
        with self.world.collective("optimizer state gather"):
            return gather_state(self.layout, self.pieces, self.views, self.optimizer)

    def load_state_dict(self, full: dict) -> None:
        """Take this rank's shard of a single-process ``state_dict()`` (any world size wrote it)."""
        scatter_state(self.layout, self.pieces, self.views, self.optimizer, full)


def _unpack(stage: StageShard, work: dist.Work, full: torch.Tensor) -> None:
    work.wait()
    with torch.no_grad():
        for p, off in zip(stage.params, stage.offsets):
            p.view(-1).copy_(full[off:off + p.numel()])
