"""Costs of a chain whose chosen stages keep their tapes on a lower tier between their forward
and their backward, instead of in the compute tier.

Pure data: the memory side. An offloaded tape is written out as the forward saves it and
read back while the next-later stage's backward runs, so between the two it costs no
compute-tier memory: its bytes move from the stage's ``tape`` into its forward and backward
transients. Two tapes are in flight at any time (one being written, one read ahead), the
static bytes that offloading adds; without read-ahead (``read_ahead=False``, a prefetch
depth of 0) only the tape being written. Reading ahead, one of the two is free outside the
window from the first read to the end of the last write (``plan/buffer_windows.py``). The
writes and reads are the plan's ops (``plan/tape_schedule.py``), priced at the
``bandwidths`` set here.
"""
from __future__ import annotations

from collections.abc import Set
from dataclasses import replace

from .costs import ChainCosts
from .streaming import TRANSFER_RESOURCES

MIN_TAPE_BYTES = 1 << 20  # smaller saved tensors stay in memory: not worth a file


def activation_tape(costs: ChainCosts, i: int, streamed: Set[int]) -> int:
    """Bytes of stage i's tape that are its activations (a streamed stage's tape holds its
    weights too)."""
    s = costs.stages[i]
    return s.tape - (s.weight_bytes if i in streamed else 0)


def offloaded_tape_costs(costs: ChainCosts, stages: set[int], *, home: str,
                         read_bytes_per_s: float, write_bytes_per_s: float,
                         read_ahead: bool = True,
                         streamed: Set[int] = frozenset()) -> ChainCosts:
    """``costs`` with the tapes of ``stages`` kept on the lower tier ``home``; ``streamed``:
    the stages whose weights ``costs`` streams (their tapes hold those weights)."""
    if not stages:
        return costs
    moved = list(costs.stages)
    activations = {i: activation_tape(costs, i, streamed) for i in stages}
    for i in sorted(stages):
        s = moved[i]
        moved[i] = replace(s, tape=0,
                           fwd_transient=s.fwd_transient + activations[i],
                           bwd_transient=s.bwd_transient + activations[i])
    in_flight = (2 if read_ahead else 1) * max(activations.values())
    extra = {**costs.extra, "offloaded tapes": sorted(stages),
             "offloaded tape bytes": sum(activations.values())}
    read, write = TRANSFER_RESOURCES[home]
    return replace(costs, stages=tuple(moved), static_bytes=costs.static_bytes + in_flight,
                   tape_buffer_bytes=max(activations.values()) if read_ahead else 0,
                   bandwidths={**costs.bandwidths, read: read_bytes_per_s,
                               write: write_bytes_per_s}, extra=extra)
