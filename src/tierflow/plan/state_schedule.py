"""Where a plan moves the optimizer states that live on a lower tier between updates:
``Load`` and ``Store`` ops of ``what="states"`` placed beside its updates.

Pure data. Each update of a stage whose states live below (``KeptBelow``) is preceded by
the Load of its states and followed by their Store. Reading ahead, the Load starts right
after the update before it, so that the read overlaps that update and what runs until the
stage's own (the first update of a list is read after its last, the same list running
again); read on demand, it comes right before the update and waits for the write of the
states updated before (``Load.after_store``), so that one stage's states are in memory at
a time, in the one buffer that write frees. The stages the optimizer steps in
host RAM move their own states there (``exec/host_update.py``) and have none of these ops,
but an update of theirs still starts the read of the next stage's states.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kept_below import KeptBelow
from .ops import Op, Update

STATES = "states"  # what these transfers move


def with_state_transfers(ops: Sequence[Op], states: KeptBelow) -> tuple[Op, ...]:
    """``ops`` with the Loads and Stores of the states of the stages their Updates step."""
    stages = states.stages
    updates = [op.stage for op in ops if isinstance(op, Update)]
    following = {i: j for i, j in zip(updates, updates[1:] + updates[:1])}  # cyclic
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Update) and op.stage in stages and not states.read_ahead:
            out.append(states.load(op.stage, after_store=True))
        out.append(op)
        if isinstance(op, Update):
            if op.stage in stages:
                out.append(states.store(op.stage))
            if states.read_ahead and following[op.stage] in stages:
                out.append(states.load(following[op.stage]))
    return tuple(out)


def first_read(ops: Sequence[Op], states: KeptBelow) -> tuple[Op, ...]:
    """The read a list's first update needs when nothing was read ahead of it (the first
    step, reading ahead: later, the list's last update reads it)."""
    first = next((op.stage for op in ops if isinstance(op, Update)), None)
    if not states.read_ahead or first not in states.stages:
        return ()
    return (states.load(first),)
