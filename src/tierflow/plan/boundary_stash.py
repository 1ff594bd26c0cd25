"""Costs of a chain whose checkpoints (stage boundaries x[i] a plan keeps to recompute from)
may wait on a lower tier instead of in the compute tier: offloading beside recomputation.

Pure data: the memory side. A stashed x[a] is written out after Forward(a) has read it,
while the next stage's forward runs, and read back while a later stage's backward runs
(one backward ahead of its Fetch). A boundary is stashable only when both would hide
behind that compute; it is worth a file only from ``MIN_BOUNDARY_BYTES``. At most one
write and one read are in flight: the static bytes this adds. The writes and reads are the
plan's ops (``plan/boundary_schedule.py``), priced at the ``bandwidths`` set here. Rotor, given stashable boundaries, then recomputes less at a small budget: it
no longer pays for a checkpoint's memory while later segments run (``rotor.py``).
"""
from __future__ import annotations

from dataclasses import replace

from .costs import ChainCosts
from .streaming import TRANSFER_RESOURCES

MIN_BOUNDARY_BYTES = 1 << 20  # smaller boundaries stay in memory: not worth a file


def stashable_boundaries(costs: ChainCosts, *, read_bytes_per_s: float,
                         write_bytes_per_s: float, min_bytes: int = MIN_BOUNDARY_BYTES
                         ) -> list[int]:
    """The boundaries x[a] worth stashing whose write hides behind stage a+1's forward and
    whose read behind any backward after stage a. Only 0 < a < L-1 can be stashed: x[0] is
    the caller's, and a forward without tape (which stashes its input) never runs the last
    stage."""
    stages = costs.stages
    out = []
    for a in range(1, costs.length - 1):
        size = costs.x_bytes(a)
        shortest_backward = min(s.bwd_time for s in stages[a + 1:])
        if size >= min_bytes and size / write_bytes_per_s <= stages[a + 1].fwd_time \
                and size / read_bytes_per_s <= shortest_backward:
            out.append(a)
    return out


def stashed_boundary_costs(costs: ChainCosts, boundaries: list[int], *, home: str,
                           read_bytes_per_s: float, write_bytes_per_s: float) -> ChainCosts:
    """``costs`` with ``boundaries`` stashable on the lower tier ``home`` and their bytes in
    flight static."""
    if not boundaries:
        return costs
    sizes = [costs.x_bytes(a) for a in boundaries]
    extra = {**costs.extra, "stashable boundaries": sorted(boundaries),
             "stashable boundary bytes": sum(sizes)}
    read, write = TRANSFER_RESOURCES[home]
    return replace(costs, stashable=tuple(sorted(boundaries)),
                   static_bytes=costs.static_bytes + 2 * max(sizes), extra=extra,
                   bandwidths={**costs.bandwidths, read: read_bytes_per_s,
                               write: write_bytes_per_s})
