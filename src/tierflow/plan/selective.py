"""Costs of a chain whose chosen stages run their taped forwards selectively: each keeps the
outputs of its matmuls and attention, and its backward recomputes the cheap rest (norms,
activations, rotary embeddings, element-wise work) from them first (exec/selective.py).

Pure data. A costs transform, like ``tape_offload``: a selective stage's tape, backward time
and transients become its ``SelectiveCost``'s, so rotor plans on the smaller tape and may
still recompute whole stages on top; the search weighs the candidate against its twin that
keeps whole tapes. The tape keeps no weights (the recomputation reads the stage's weights
again, which the plan brings back for its backward), so a streamed stage's weights leave it
as they leave an offloaded tape.
"""
from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import replace

from .costs import ChainCosts
from .ops import Forward, Op


def selectable(costs: ChainCosts, exclude: Set[int] = frozenset()) -> frozenset[int]:
    """The stages whose selective variant keeps less than their tape holds (a streamed
    stage's tape counts its weights), ``exclude`` left out (offloaded tapes)."""
    return frozenset(i for i, s in enumerate(costs.stages)
                     if s.selective is not None and s.needs_backward and i not in exclude
                     and s.selective.tape < s.tape)


def selective_costs(costs: ChainCosts, stages: Iterable[int]) -> ChainCosts:
    """``costs`` with ``stages`` run selectively (each must have a ``SelectiveCost``)."""
    chosen = sorted(set(stages) | set(costs.selective))
    if chosen == list(costs.selective):
        return costs
    moved = list(costs.stages)
    for i in chosen:
        s = moved[i]
        if i in costs.selective:
            continue
        if s.selective is None:
            raise ValueError(f"stage {s.name} has no selective variant")
        v = s.selective
        moved[i] = replace(s, tape=v.tape, bwd_time=s.bwd_time + v.recompute_time,
                           fwd_transient=v.fwd_transient, bwd_transient=v.bwd_transient)
    saved = sum(costs.stages[i].tape - moved[i].tape for i in chosen
                if i not in costs.selective)
    extra = {**costs.extra, "selective stages": len(chosen),
             "selective tape savings": costs.extra.get("selective tape savings", 0) + saved}
    return replace(costs, stages=tuple(moved), selective=tuple(chosen), extra=extra)


def mark_selective(ops: Iterable[Op], stages: Set[int]) -> tuple[Op, ...]:
    """``ops`` with every taped forward of ``stages`` selective."""
    return tuple(Forward(op.stage, True, True)
                 if isinstance(op, Forward) and op.tape and op.stage in stages else op
                 for op in ops)


def check_selective(costs: ChainCosts, ops: Iterable[Op]) -> None:
    """ValueError unless the taped forwards that run selectively are exactly those of the
    stages the costs price so."""
    stages = set(costs.selective)
    for op in ops:
        if isinstance(op, Forward) and op.tape and op.selective != (op.stage in stages):
            raise ValueError(f"{op}: the costs price stage {op.stage}'s tape as "
                             f"{'selective' if op.stage in stages else 'whole'}")
