"""Which rank owns which elements: each stage's trainable parameters, flattened in stage
order, are cut into ``world`` equal shards (the last one padded with zeros).

Sharding stage by stage (not the whole model at once) keeps every collective the size of one
stage, so a stage's gradients can be reduced as soon as its backward is done, and each rank
holds 1/N of every stage's optimizer states. A parameter that several stages use (a tied
embedding and LM head) belongs to the first of them: its gradient is complete only after
that stage's backward, which runs last.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..core.errors import TierflowError


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in this rank's shard of its stage."""
    param: nn.Parameter
    index: int  # the parameter's position in the optimizer's order (the checkpoint's index)
    group: int  # its param group
    start: int  # first element, in the parameter's flattened elements
    stop: int  # one past the last
    offset: int  # where ``start`` lands in this rank's shard of the stage

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class StageShard:
    """One stage's parameters as a flat vector of ``numel`` elements, cut in ``world`` shards
    of ``shard`` elements; ``pieces`` are this rank's."""
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in the flat vector
    numel: int
    shard: int
    world: int
    pieces: list[Piece]

    @property
    def padded(self) -> int:
        """Elements of the flat vector with the last shard's zero padding."""
        return self.shard * self.world


class ShardLayout:
    """The layout of every stage's shards for ``rank`` of ``world`` ranks.

    ``stage_params`` lists each stage's parameters (as ``stage.parameters()`` yields them);
    ``groups`` are the optimizer's param groups of full parameters, whose concatenated order
    numbers the parameters as a single-process optimizer's state dict does."""

    def __init__(self, stage_params: Sequence[Sequence[nn.Parameter]],
                 groups: Sequence[Sequence[nn.Parameter]], rank: int, world: int):
        self.rank = rank
        self.world = world
        self.order: list[nn.Parameter] = [p for group in groups for p in group]
        where = {id(p): (i, g) for i, (p, g) in enumerate(
            (p, g) for g, group in enumerate(groups) for p in group)}
        owner: dict[int, int] = {}
        for s, params in enumerate(stage_params):
            for p in {id(p): p for p in params}.values():
                if id(p) in where:
                    owner.setdefault(id(p), s)
        stray = [i for i, p in enumerate(self.order) if id(p) not in owner]
        if stray:
            raise TierflowError(f"{len(stray)} optimized parameters belong to no stage of the "
                                "chain: optimize the parameters of the fitted model only")
        dtypes = {p.dtype for p in self.order}
        if len(dtypes) > 1:
            raise TierflowError(f"the trainable parameters have several dtypes ({dtypes}): "
                                "sharding needs one; load the model in one dtype")
        if not all(p.is_contiguous() for p in self.order):
            raise TierflowError("a trainable parameter is not contiguous: sharding aliases "
                                "parameter storage; make the model's parameters contiguous")
        self.group_sizes = [len(group) for group in groups]
        self.stages: list[StageShard] = []
        for s, params in enumerate(stage_params):
            owned = [p for p in {id(p): p for p in params}.values() if owner.get(id(p)) == s]
            self.stages.append(self._stage(owned, where))
        self.stage_of = owner  # id(param) -> the stage that owns it
        if not any((world - 1) * stage.shard < stage.numel for stage in self.stages):
            raise TierflowError(f"no stage has enough parameter elements to give each of "
                                f"{world} ranks a shard: use fewer ranks")

    def _stage(self, params: list[nn.Parameter], where: dict[int, tuple[int, int]]) -> StageShard:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        shard = -(-numel // self.world)
        lo, hi = self.rank * shard, min((self.rank + 1) * shard, numel)
        pieces = []
        for p, off in zip(params, offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                index, group = where[id(p)]
                pieces.append(Piece(p, index, group, a - off, b - off, a - lo))
        return StageShard(params, offsets, numel, shard, self.world, pieces)

    def pieces(self) -> list[Piece]:
        """This rank's pieces, stage by stage."""
        return [piece for stage in self.stages for piece in stage.pieces]
