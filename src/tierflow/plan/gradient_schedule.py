"""Where a plan moves the gradients of its streamed stages when updates are deferred
(gradient accumulation, clipping): ``Store`` and ``Load`` ops of ``what="grads"`` placed
beside its backwards and updates.

Pure data. With updates deferred, a stage's ``Update(i)`` in a micro-batch's ops only says
that its gradients are complete; a streamed stage's must then outlive its backward without
staying in memory. They live on the tier its weights live on (``KeptBelow``, the weights'
``home``): a Store right after that ``Update(i)`` writes them down (behind the next
backward; the next such Store waits until this one is written, as the executor bounds the
writes in flight), and, accumulating over micro-batches, a Load right before the stage's
next ``Backward(i)`` reads them back for autograd to add to (the first micro-batch of a step
finds nothing written: its Loads do nothing, and the price counts them all the same). In the
update pass a Load of a stage's gradients comes right after the Load of its weights (read
ahead as they are), or right before its ``Update(i)`` when its weights are in memory
already; the update waits for it.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kept_below import KeptBelow
from .ops import WEIGHTS, Backward, Load, Op, Update

GRADS = "grads"  # what these transfers move: a stage's accumulated parameter gradients


def with_gradient_transfers(step: Sequence[Op], grads: KeptBelow,
                            accumulates: bool) -> tuple[Op, ...]:
    """A micro-batch's ``step`` with the Stores of the gradients its Updates complete and,
    ``accumulates``, the Loads that bring them back before each of those stages' Backward."""
    stages = grads.stages
    out: list[Op] = []
    for op in step:
        if accumulates and isinstance(op, Backward) and op.stage in stages:
            out.append(grads.load(op.stage))
        out.append(op)
        if isinstance(op, Update) and op.stage in stages:
            out.append(grads.store(op.stage))
    return tuple(out)


def with_gradient_reads(update_pass: Sequence[Op], grads: KeptBelow) -> tuple[Op, ...]:
    """The ``update_pass`` with the Load of each updated stage's gradients: beside the Load
    of its weights, else right before its Update (not for an Update in host RAM: the host
    optimizer takes a stage's gradients where they wait, ``exec/gradients.take``)."""
    stages = grads.stages
    updated = {op.stage for op in update_pass if isinstance(op, Update)
               and not op.on_host} & set(stages)
    read: set[int] = set()
    out: list[Op] = []
    for op in update_pass:
        if isinstance(op, Update) and op.stage in updated and op.stage not in read:
            out.append(grads.load(op.stage))
            read.add(op.stage)
        out.append(op)
        if isinstance(op, Load) and op.what == WEIGHTS and op.stage in updated \
                and op.stage not in read:
            out.append(grads.load(op.stage))
            read.add(op.stage)
    return tuple(out)
