"""The two fixed strategies: keep every activation, or checkpoint every stage's input. Both
run a forward-only prefix (plan/forward_only.py) once, without tapes."""
from __future__ import annotations

from .costs import ChainCosts
from .forward_only import planned_with_prefix
from .ops import Backward, Fetch, Forward, Op, Stash, Update


def keep_all(costs: ChainCosts) -> list[Op]:
    """Plain autograd: every forward keeps its tape; nothing is recomputed."""
    return planned_with_prefix(costs, _keep_all)


def checkpoint_all(costs: ChainCosts) -> list[Op]:
    """Keep only each stage's input; recompute each stage's forward right before its backward.

    The last stage keeps its tape on the first pass, since its backward comes right after.
    The stashable inputs (``costs.stashable``) wait on the tier below between their first
    forward and the recomputation: offload beside recomputation.
    """
    return planned_with_prefix(costs, _checkpoint_all)


def _keep_all(costs: ChainCosts) -> list[Op]:
    length = costs.length
    ops: list[Op] = [Forward(i, tape=True) for i in range(length)]
    for i in reversed(range(length)):
        ops.append(Backward(i))
        if costs.optimizer_owned:
            ops.append(Update(i))
    return ops


def _checkpoint_all(costs: ChainCosts) -> list[Op]:
    length = costs.length
    ops: list[Op] = []
    for i in range(length):
        ops.append(Forward(i, tape=i == length - 1))
        if i in costs.stashable and i < length - 1:
            ops.append(Stash(i))
    for i in reversed(range(length)):
        if i < length - 1:
            if i in costs.stashable:
                ops.append(Fetch(i))
            ops.append(Forward(i, tape=True))
        ops.append(Backward(i))
        if costs.optimizer_owned:
            ops.append(Update(i))
    return ops
