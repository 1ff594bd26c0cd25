"""Where a plan moves the gradients of its streamed stages when updates are deferred
(gradient accumulation, clipping): ``Store`` and ``Load`` ops of ``what="grads"`` placed
beside its backwards and updates.

Pure data. With updates deferred, a stage's ``Update(i)`` in a micro-batch's ops only says
that its gradients are complete; a streamed stage's must then outlive its backward without
staying in memory. They live on the tier its weights live on (``KeptBelow``, the weights'
``home``): a Store right after that ``Update(i)`` writes them down (behind the next
backward; the next such Store waits until this one is written, as the executor bounds the
writes in flight), and, accumulating over micro-batches, a Load reads them back for autograd
to add to in the stage's next ``Backward(i)``: reading ahead, right before the backward
before it (the read overlaps that backward and the recomputations between), else right
before its own. They are held from their Load on (``plan/simulate.py`` counts them). The
first micro-batch of a step finds nothing written: its Loads do nothing, and
``Plan.step_time`` prices it without them. In the
update pass a Load of a stage's gradients comes right after the Load of its weights (read
ahead as they are), or right before its ``Update(i)`` when its weights are in memory
already; the update waits for it.

A stage the host optimizer steps (``Update(i, "host optimizer")``) takes its gradients in
host RAM. Inside the backward a Store of them down to that RAM (``host``, on "copy down")
comes right after its ``Backward(i)``; in the update pass, right before its Update when
they stayed on the compute tier over the micro-batches (a resident stage's, or the tied
parameters' of a streamed first stage), and a Load of them from the disk they wait on into
host RAM (``Load(grads, i, "disk", "ram", ...)``) when the stage is streamed from disk; a
stage streamed from host RAM finds them there. Its Update waits for both.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kept_below import KeptBelow
from .ops import WEIGHTS, Backward, Load, Op, Update

GRADS = "grads"  # what these transfers move: a stage's accumulated parameter gradients
HOST_RAM = "ram"  # the tier the host optimizer steps in


def with_gradient_transfers(step: Sequence[Op], grads: KeptBelow,
                            accumulates: bool) -> tuple[Op, ...]:
    """A micro-batch's ``step`` with the Stores of the gradients its Updates complete and,
    ``accumulates``, the Loads that bring them back for each of those stages' Backward:
    right before the Backward before it when ``grads.read_ahead`` (the first Backward's
    right before it), else right before its own."""
    stages = grads.stages
    backwards = [op.stage for op in step if isinstance(op, Backward)]
    ahead = dict(zip(backwards, backwards[1:])) if grads.read_ahead else {}
    out: list[Op] = []
    for op in step:
        if accumulates and isinstance(op, Backward):
            reads = [op.stage] if not grads.read_ahead or op.stage == backwards[0] else []
            reads += [ahead[op.stage]] if op.stage in ahead else []
            out += [grads.load(i) for i in reads if i in stages]
        out.append(op)
        if isinstance(op, Update) and op.stage in stages:
            out.append(grads.store(op.stage))
    return tuple(out)


def with_host_gradient_stores(step: Sequence[Op], host: KeptBelow) -> tuple[Op, ...]:
    """A step whose updates run inside the backward, with the Store of each ``host`` stage's
    gradients to host RAM right after its Backward (its host Update waits for it)."""
    stages = host.stages
    out: list[Op] = []
    for op in step:
        out.append(op)
        if isinstance(op, Backward) and op.stage in stages:
            out.append(host.store(op.stage))
    return tuple(out)


def with_gradient_reads(update_pass: Sequence[Op], grads: KeptBelow | None,
                        host: KeptBelow | None = None) -> tuple[Op, ...]:
    """The ``update_pass`` with the Load of each updated stage's gradients: beside the Load
    of its weights, else right before its Update. Right before an Update in host RAM: the
    Store down of a ``host`` stage's gradients, or the Load into host RAM of a stage's that
    wait on disk (none for those waiting in host RAM already)."""
    stages = grads.stages if grads is not None else {}
    down = host.stages if host is not None else {}
    updated = {op.stage for op in update_pass if isinstance(op, Update)
               and not op.on_host} & set(stages)
    read: set[int] = set()
    out: list[Op] = []
    for op in update_pass:
        if isinstance(op, Update) and op.on_host:
            if op.stage in down:
                out.append(host.store(op.stage))
            if op.stage in stages and grads.home != HOST_RAM:
                out.append(Load(GRADS, op.stage, grads.home, HOST_RAM, grads.read,
                                stages[op.stage]))
        elif isinstance(op, Update) and op.stage in updated and op.stage not in read:
            out.append(grads.load(op.stage))
            read.add(op.stage)
        out.append(op)
        if isinstance(op, Load) and op.what == WEIGHTS and op.stage in updated \
                and op.stage not in read:
            out.append(grads.load(op.stage))
            read.add(op.stage)
    return tuple(out)
