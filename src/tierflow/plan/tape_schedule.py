"""Where a plan moves the tapes it keeps on a lower tier: ``Store``, ``Load`` and ``Drop`` ops
of ``what="tape"`` placed among its ops.

Pure data. A taped forward of a stage whose tape is kept below (a ``KeptBelow``) whose backward does not follow at
once sends its tape down as the forward saves it: a Store right before that Forward (its
writes run beside the forward; the next such Store waits until this one is written, as the
executor bounds the tapes in flight). The tape comes back for the stage's backward: its Load
right before the backward before it (reading ahead: the read overlaps that backward) or
right before its own; a Drop after its backward forgets it.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kept_below import KeptBelow
from .ops import TRANSFERS, Backward, Drop, Forward, Op

TAPE = "tape"  # what these transfers move


def tapes_below(ops: Sequence[Op], stages: set[int] | frozenset[int]) -> set[int]:
    """Positions (in ``ops``) of the taped forwards whose tapes go down: of ``stages``, and
    not followed at once by their backward (the next compute op)."""
    out = set()
    for position, op in enumerate(ops):
        if isinstance(op, Forward) and op.tape and op.stage in stages:
            after = next((later for later in ops[position + 1:]
                          if not isinstance(later, TRANSFERS)), None)
            if not (isinstance(after, Backward) and after.stage == op.stage):
                out.add(position)
    return out


def with_tape_transfers(ops: Sequence[Op], tapes: KeptBelow) -> tuple[Op, ...]:
    """``ops`` with the Stores, Loads and Drops of the tapes that go down."""
    sizes = tapes.stages
    below = tapes_below(ops, set(sizes))
    down = {ops[p].stage for p in below}
    backwards = [op.stage for op in ops if isinstance(op, Backward)]
    ahead = {j: i for i, j in zip(backwards[1:], backwards)}  # read during j's backward
    out: list[Op] = []
    for position, op in enumerate(ops):
        if position in below:
            out.append(tapes.store(op.stage))
        if isinstance(op, Backward):
            read = ahead.get(op.stage) if tapes.read_ahead else op.stage
            if tapes.read_ahead and op.stage == backwards[0] and op.stage in down:
                out.append(tapes.load(op.stage))  # the first backward's, nothing before
            if read in down:
                out.append(tapes.load(read))
        out.append(op)
        if isinstance(op, Backward) and op.stage in down:
            out.append(Drop(TAPE, op.stage, tapes.compute))
    return tuple(out)

