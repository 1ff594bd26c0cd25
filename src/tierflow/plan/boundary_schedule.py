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
from dataclasses import dataclass

from .ops import Backward, Fetch, Free, Load, Op, Stash, Store

BOUNDARY = "boundary"  # what these transfers move: a checkpoint x[a]


@dataclass(frozen=True)
class StashedBoundaries:
    """Per stashable checkpoint x[a], its bytes (``sizes``: (a, bytes)), kept on the lower
    tier ``home`` and moved from and to the ``compute`` tier on the resources ``write`` and
    ``read``, read one backward ahead of its Fetch or at it."""

    sizes: tuple[tuple[int, int], ...]
    home: str
    compute: str
    read: str
    write: str
    read_ahead: bool

    def to_dict(self) -> dict:
        return {"sizes": [list(pair) for pair in self.sizes], "home": self.home,
                "compute": self.compute, "read": self.read, "write": self.write,
                "read_ahead": self.read_ahead}

    @classmethod
    def from_dict(cls, data: dict) -> "StashedBoundaries":
        return cls(sizes=tuple((int(a), int(n)) for a, n in data["sizes"]), home=data["home"],
                   compute=data["compute"], read=data["read"], write=data["write"],
                   read_ahead=bool(data["read_ahead"]))


def with_boundary_transfers(ops: Sequence[Op],
                            boundaries: StashedBoundaries) -> tuple[Op, ...]:
    """``ops`` with the Stores and Loads of the checkpoints their Stash and Fetch ops move."""
    sizes = dict(boundaries.sizes)
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
        out += [Load(BOUNDARY, a, boundaries.home, boundaries.compute, boundaries.read,
                     sizes[a]) for a in loads.get(position, ())]
        out.append(op)
        if isinstance(op, Stash) and op.index not in in_store:
            in_store.add(op.index)
            out.append(Store(BOUNDARY, op.index, boundaries.compute, boundaries.home,
                             boundaries.write, sizes[op.index]))
        elif isinstance(op, (Free, Backward)):
            in_store -= _forgotten(op)
    return tuple(out)


def _forgotten(op: Free | Backward) -> set[int]:
    """The checkpoints whose stored copy ``op`` forgets (the executor's reference is gone):
    x[i] for Free(i), x[i] and x[i+1] for Backward(i)."""
    return {op.index} if isinstance(op, Free) else {op.stage, op.stage + 1}
