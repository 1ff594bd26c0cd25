"""Sharded optimizer states to and from the single-process ``state_dict()`` format.

A checkpoint holds the optimizer state exactly as one process training the full parameters
would save it (``state[i]`` per parameter in the optimizer's order, ``param_groups`` with
those indices), so it resumes on any number of ranks. ``gather_state`` collects each stage's
shards on rank 0 (one ``gather`` per stage and per state tensor, so rank 0 holds one stage's
states at a time on top of the result); ``scatter_state`` lets each rank slice its pieces out
of the full state it read from the checkpoint.

A state tensor shaped like its piece (AdamW's ``exp_avg``, ``exp_avg_sq``) is element-wise
and is cut and pasted with the parameter; any other (a 0-dim ``step``) is the same for every
piece of a parameter and is taken from the rank that owns the parameter's first element.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import TierflowError
from .layout import Piece, ShardLayout


def _state_keys(optimizer: torch.optim.Optimizer, views: Sequence[nn.Parameter]
                ) -> tuple[list[tuple[str, torch.dtype]], list[tuple[str, torch.dtype]]]:
    """(element-wise keys, per-parameter keys) of the optimizer's states, with their dtypes."""
    for view in views:
        state = optimizer.state.get(view)
        if not state:
            continue
        wise, other = [], []
        for key, value in sorted(state.items()):
            if not isinstance(value, torch.Tensor):
                other.append((key, torch.float64))
            elif value.dim() == 0:
                other.append((key, value.dtype))
            elif value.shape == view.shape:
                wise.append((key, value.dtype))
            else:
                raise TierflowError(f"the optimizer's state {key!r} has shape "
                                    f"{tuple(value.shape)}, neither element-wise nor a scalar: "
                                    "it cannot be sharded across ranks; train on one process")
        return wise, other
    raise TierflowError("the optimizer holds no state yet (no step was taken): save a "
                        "checkpoint after the first step")


def gather_state(layout: ShardLayout, pieces: Sequence[Piece], views: Sequence[nn.Parameter],
                 optimizer: torch.optim.Optimizer) -> dict | None:
    """The full ``state_dict()`` on rank 0, None on the others (a collective)."""
    wise, scalar = _state_keys(optimizer, views)
    main = layout.rank == 0
    full: dict[int, dict[str, Any]] = {i: {} for i in range(len(layout.order))}
    state_of = {id(view): optimizer.state.get(view, {}) for view in views}
    by_stage: dict[int, list[tuple[Piece, nn.Parameter]]] = {}
    for piece, view in zip(pieces, views):
        by_stage.setdefault(layout.stage_of[id(piece.param)], []).append((piece, view))
    index = {id(p): i for i, p in enumerate(layout.order)}
    for s, stage in enumerate(layout.stages):
        if stage.numel == 0:
            continue
        mine = by_stage.get(s, [])
        device = stage.params[0].device
        for key, dtype in wise:
            send = torch.zeros(stage.shard, dtype=dtype, device=device)  # (shard,)
            for piece, view in mine:
                if key in state_of[id(view)]:
                    send[piece.offset:piece.offset + piece.numel] = state_of[id(view)][key]
            parts = [torch.empty_like(send) for _ in range(layout.world)] if main else None
            dist.gather(send, parts, dst=0)
            if main:
                flat = torch.cat(parts)  # (N * shard,)
                for p, off in zip(stage.params, stage.offsets):
                    full[index[id(p)]][key] = flat[off:off + p.numel()].view_as(p).clone()
        for key, dtype in scalar:
            send = torch.zeros(len(stage.params), dtype=torch.float64, device=device)
            position = {id(p): j for j, p in enumerate(stage.params)}
            for piece, view in mine:
                if piece.start == 0 and key in state_of[id(view)]:
                    send[position[id(piece.param)]] = float(state_of[id(view)][key])
            parts = [torch.empty_like(send) for _ in range(layout.world)] if main else None
            dist.gather(send, parts, dst=0)
            if main:
                for j, (p, off) in enumerate(zip(stage.params, stage.offsets)):
                    owner = off // stage.shard
                    full[index[id(p)]][key] = torch.tensor(float(parts[owner][j]), dtype=dtype)
    if not main:
        return None
    groups, start = [], 0
    for group, size in zip(optimizer.state_dict()["param_groups"], layout.group_sizes):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + size))})
        start += size
    return {"state": full, "param_groups": groups}


def scatter_state(layout: ShardLayout, pieces: Sequence[Piece], views: Sequence[nn.Parameter],
                  optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Load this rank's pieces of ``full`` (a single-process ``state_dict()``) into
    ``optimizer``, the optimizer over ``views``."""
    saved_groups = full.get("param_groups", [])
    sizes = [len(g.get("params", [])) for g in saved_groups]
    if sizes != layout.group_sizes:
        raise TierflowError(f"the checkpoint's optimizer state has param groups of {sizes} "
                            f"parameters, the model {layout.group_sizes}: resume with the model "
                            "the checkpoint was trained with")
    saved = full.get("state", {})
    position = {id(v): i for i, v in enumerate(v for g in optimizer.param_groups
                                                for v in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for piece, view in zip(pieces, views):
        entry = saved.get(piece.index)
        if entry is None:
            continue
        state[position[id(view)]] = {k: (v.reshape(-1)[piece.start:piece.stop].clone()
                        if isinstance(v, torch.Tensor) and v.shape == piece.param.shape
                        and v.dim() > 0 else v) for k, v in entry.items()}
    groups, start = [], 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        count = len(group["params"])
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})
