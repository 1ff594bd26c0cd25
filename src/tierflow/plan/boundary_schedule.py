"""Where a plan moves the checkpoints it stashes on a lower tier: a ``Store`` and a ``Load`` of
``what="boundary"`` beside each ``Stash(a)`` and ``Fetch(a)`` of its ops.

Pure data. ``Stash(a)`` hands x[a] over (the compute tier no longer holds it) and the Store
right after it writes it down; the next such Store waits until that one is written (the
executor bounds the writes in flight, as the costs count them). A checkpoint stashed again
before it was freed is in the store already: no second Store. Its Load comes right before
the backward before its ``Fetch(a)`` (reading ahead: the read overlaps that backward), or
right before the Fetch without read-ahead or when no backward runs between the two; the
Fetch waits for it.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kept_below import KeptBelow
from .ops import Backward, Fetch, Free, Op, Stash

BOUNDARY = "boundary"  # what these transfers move: a checkpoint x[a]


def with_boundary_transfers(ops: Sequence[Op],
                            boundaries: KeptBelow) -> tuple[Op, ...]:
    """``ops`` with the Stores and Loads of the checkpoints their Stash and Fetch ops move."""
    loads: dict[int, list[int]] = {}  # position -> the checkpoints read before that op
    in_store: set[int] = set()
    stored_at: dict[int, int] = {}  # a -> position of the Stash its Store follows
    last_backward: int | None = None  # position of the latest backward so far
    for position, op in enumerate(ops):
        if isinstance(op, Stash) and op.index not in in_store:
            in_store.add(op.index)
            stored_at[op.index] = position
        elif isinstance(op, (Free, Backward)):
            in_store -= _forgotten(op)
            last_backward = position if isinstance(op, Backward) else last_backward
        elif isinstance(op, Fetch):
            ahead = boundaries.read_ahead and last_backward is not None \
                and last_backward > stored_at[op.index]
            loads.setdefault(last_backward if ahead else position, []).append(op.index)
    out: list[Op] = []
    in_store.clear()
    for position, op in enumerate(ops):
        out += [boundaries.load(a) for a in loads.get(position, ())]
        out.append(op)
        if isinstance(op, Stash) and op.index not in in_store:
            in_store.add(op.index)
            out.append(boundaries.store(op.index))
        elif isinstance(op, (Free, Backward)):
            in_store -= _forgotten(op)
    return tuple(out)


def _forgotten(op: Free | Backward) -> set[int]:
    """The checkpoints whose stored copy ``op`` forgets (the executor's reference is gone):
    x[i] for Free(i), x[i] and x[i+1] for Backward(i)."""
    return {op.index} if isinstance(op, Free) else {op.stage, op.stage + 1}
