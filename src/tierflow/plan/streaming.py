"""Costs of a chain whose chosen stages keep their weights on a lower tier and bring them
into the compute tier around their own operations: the memory side. Their time is the
plan's Load and Store ops' (``plan/weight_schedule.py`` places them, ``plan/timeline.py``
prices them at the ``bandwidths`` set here).

Pure data. A streamed stage's weights are not static any more: they are resident while the
stage runs (a forward, a backward, the update after it) and while its tape lives, so they
join the stage's tape and its transients; ``depth`` stages read ahead, plus one stage being
written back after its update, are the buffers the streaming adds to the static bytes (a
buffer of the largest streamed stage per stage of depth). A stage's frozen weights
(``frozen_bytes``) are read and held like the others but never written back.
"""
from __future__ import annotations

from dataclasses import replace

from .costs import ChainCosts, StageCost

# the resources that read and write a lower tier's weights, by tier
TRANSFER_RESOURCES = {"disk": ("disk read", "disk write"), "ram": ("copy up", "copy down")}
# resources that take turns on one device: a disk moves its bandwidth's bytes either way, not
# that many each way at once (measured: benchmarks/disk_duplex.py, a read and a write side by
# side each at about half its rate alone); a GPU's link copies both ways at once
SHARED_DEVICE = {"disk read": "disk", "disk write": "disk"}


def streamed_costs(costs: ChainCosts, streamed: set[int], *, home: str,
                   read_bytes_per_s: float, write_bytes_per_s: float,
                   depth: int) -> ChainCosts:
    """``costs`` with the weights of the ``streamed`` stages living on the lower tier
    ``home``, read at ``read_bytes_per_s`` and written back at ``write_bytes_per_s``."""
    if not streamed:
        return costs
    if depth < 0:
        raise ValueError(f"prefetch depth {depth} must be at least 0")
    stages = list(costs.stages)
    moved = 0
    for i in sorted(streamed):
        stages[i] = _streamed_stage(stages[i])
        moved += stages[i].weight_bytes
    largest = max(costs.stages[i].weight_bytes for i in streamed)
    buffers = min(depth + 1, len(streamed)) * largest
    extra = {**costs.extra, "streamed stages": sorted(streamed), "streamed bytes": moved,
             "prefetch depth": depth, "stream buffers": buffers}
    read, write = TRANSFER_RESOURCES[home]
    bandwidths = {**costs.bandwidths, read: read_bytes_per_s, write: write_bytes_per_s}
    return replace(costs, stages=tuple(stages), static_bytes=costs.static_bytes - moved + buffers,
                   bandwidths=bandwidths, extra=extra)


def _streamed_stage(s: StageCost) -> StageCost:
    return replace(s,
                   tape=s.tape + s.weight_bytes,
                   fwd_transient_nograd=s.fwd_transient_nograd + s.weight_bytes,
                   update_transient=s.update_transient + s.weight_bytes)
