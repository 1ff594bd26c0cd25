"""Which of the static buffers of transfers each op of a plan runs without, read off its
timeline: the simulation's memory then follows the plan's transfers, not their worst case.

Pure data. The costs count two buffers of optimizer states in flight in their static bytes
(``plan/tier_costs.states_below``: one read ahead of an update, one written back after it)
and, reading tapes ahead, two of tapes (``plan/tape_offload.py``: one written as a forward
saves it, one read back during the backward before its own). Neither pair is in use all
step long:
- states: once the step before's last write of states has ended (the first compute op that
  starts after it on the timeline) and until the step's first read or write of states, only
  the states read ahead for the first update are held: ``ChainCosts.state_buffer_bytes``
  (one stage's, the largest) are free;
- tapes: until the step's first read of a tape nothing is read back, and from the end of its
  last tape write (again the first compute op that starts after it) nothing is written:
  outside that window one tape's buffer (``ChainCosts.tape_buffer_bytes``) is free.
The executor frees each buffer when its write ends or its backward has used it
(``exec/optimizer.py``, ``exec/tapes.py``).
"""
from __future__ import annotations

from .costs import ChainCosts
from .ops import COMPUTE, Load, Op, Store
from .state_schedule import STATES
from .tape_schedule import TAPE
from .timeline import Timeline


def unheld_bytes(costs: ChainCosts, ops: tuple[Op, ...], between: tuple[Op, ...],
                 line: Timeline) -> tuple[int, ...] | None:
    """Per op of ``ops``, the bytes of the static buffers it runs without (None: none is
    ever free). ``line``: the timeline of ``ops`` followed by ``between``."""
    if not (costs.state_buffer_bytes or costs.tape_buffer_bytes):
        return None
    every = (*ops, *between)
    unheld = [0] * len(ops)
    states_done = _first_after_writes(every, line, STATES, len(ops), next_step=True)
    states_used = _first(ops, STATES, (Load, Store))
    if costs.state_buffer_bytes and states_done is not None and states_used is not None:
        for position in range(states_done, states_used):
            unheld[position] += costs.state_buffer_bytes
    tapes_read = _first(ops, TAPE, (Load,))
    tapes_done = _first_after_writes(every, line, TAPE, len(ops), next_step=False)
    if costs.tape_buffer_bytes and tapes_read is not None and tapes_done is not None:
        for position in (*range(tapes_read), *range(max(tapes_read, tapes_done), len(ops))):
            unheld[position] += costs.tape_buffer_bytes
    return tuple(unheld)


def _first(ops: tuple[Op, ...], what: str, kinds: tuple[type, ...]) -> int | None:
    """The position of the first transfer of ``what`` of ``kinds`` in ``ops``."""
    return next((p for p, op in enumerate(ops) if isinstance(op, kinds) and op.what == what),
                None)


def _first_after_writes(every: tuple[Op, ...], line: Timeline, what: str, length: int,
                        next_step: bool) -> int | None:
    """The position of the first compute op (among the first ``length``) that the timeline
    starts after the last write of ``what`` ended: in the next repetition (``next_step``), or
    in the same one. None: nothing writes ``what``."""
    ends = [s.end for s in line.spans
            if isinstance(every[s.position], Store) and every[s.position].what == what]
    if not ends:
        return None
    done = max(ends) - (line.time if next_step else 0.0)
    return next((s.position for s in line.spans if s.resource == COMPUTE
                 and s.position < length and s.start >= done), length)
