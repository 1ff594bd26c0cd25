"""The stages at the front of a chain that need no backward, planned apart from the rest.

Pure data. When nothing in a stage or before it trains (a fine-tune's frozen embedding and
lower layers, whose input needs no gradient either), plain autograd records nothing for it
and never runs its backward. Such stages (``StageCost.needs_backward`` False) form a prefix
of the chain: they run once, forward only, without a tape, each input dropped as soon as
the next one exists. The rest of the chain is planned as a chain of its own whose input is
the prefix's output, held through the step beside the caller's input; its ops are then
renumbered into the whole chain's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .costs import ChainCosts
from .ops import Backward, Fetch, Forward, Free, Op, Stash, Update


def forward_only_length(costs: ChainCosts) -> int:
    """How many stages at the front of the chain need no backward (the last stage always
    gets one: the step's loss comes out of it)."""
    k = 0
    while k < costs.length - 1 and not costs.stages[k].needs_backward:
        k += 1
    return k


def after_prefix(costs: ChainCosts, k: int) -> ChainCosts:
    """The chain of stages k.. on its own: its input x[k] is held for the whole step, beside
    the caller's x[0]; its stashable boundaries renumbered."""
    return replace(costs, stages=costs.stages[k:],
                   input_bytes=costs.input_bytes + costs.x_bytes(k),
                   stashable=tuple(j - k for j in costs.stashable if j > k))


def prefix_ops(k: int) -> list[Op]:
    """The forward-only prefix: x[1..k] computed without tapes, each freed once used."""
    ops: list[Op] = [Forward(0, tape=False)] if k else []
    for i in range(1, k):
        ops += [Forward(i, tape=False), Free(i)]
    return ops


def renumbered(ops: list[Op], k: int) -> list[Op]:
    """The ops of the chain of stages k.. as ops of the whole chain."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, (Forward, Backward, Update)):
            out.append(replace(op, stage=op.stage + k))
        elif isinstance(op, (Free, Stash, Fetch)):
            out.append(replace(op, index=op.index + k))
        else:
            raise TypeError(f"unknown op {op!r}")
    return out


def planned_with_prefix(costs: ChainCosts,
                        plan_rest: Callable[[ChainCosts], list[Op]]) -> list[Op]:
    """``plan_rest``'s ops for the stages after the forward-only prefix, behind the prefix's
    own ops (``plan_rest(costs)`` itself when there is no prefix)."""
    k = forward_only_length(costs)
    if k == 0:
        return plan_rest(costs)
    return prefix_ops(k) + renumbered(plan_rest(after_prefix(costs, k)), k)
