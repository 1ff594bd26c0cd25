"""Rotor: the fastest persistent checkpointing schedule of a chain under an activation budget.

The dynamic program of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova, "Optimal
checkpointing for heterogeneous chains" (2019/2021), rebuilt on tierflow's cost model so
that the memory it predicts is exactly what ``simulate()`` measures. Pure Python + numpy.

Segments. Solving segment [a, b] means running the backward of stages a..b (and, when
tierflow owns the optimizer, their updates) starting from a state that holds x[a] and
grad[b+1] (no grad for b = L-1: the loss needs none), and ending right after Backward(a).
Every rotor schedule of [a, b] starts in one of two ways:

1. tape:        Forward(a, tape) ; solve [a+1, b] ; Backward(a) [; Update(a)]
                (for a == b the middle is Free(a+1) unless stage a's tape holds its
                output: the backward needs grad[a+1], not x[a+1])
2. checkpoint:  Forward(a..j-1, no tape), Free-ing each x[k] for a < k < j as soon as x[k+1]
                exists ; solve [j, b] ; solve [a, j-1]         (for some a < j <= b)

The bytes each step of a segment needs are ``rotor_model.SegmentNeeds``'s (its docstring
derives them, stashed boundaries included).

Schedule class. This is the optimum among the schedules the paper's DP builds: persistent
ones (an x[k] is dropped right after it is made or after its one use as a transit value,
else kept until its backward) whose taped forwards make their output (Forward(i, tape)
never runs while x[i+1] is resident). Outside that class a step can be faster (drop a used
checkpoint, recompute it later from an earlier one) or fit lower (tape stage i after stage
i+1, while x[i+1] is still held); tests/test_rotor.py shows a chain for each.

Time: C(a, b, m) = min(fwd[a] + C(a+1, b, m - X[a] - T[a]) + bwd[a] + upd[a],
                       min_j sum(fwd[a..j-1]) + C(j, b, m - X[a]) + C(a, j-1, m - lin(j, b))).
The table holds C for every m in 0..budget; each segment is one numpy step over all its
splits and all m at once.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Callable

import numpy as np

from ..core.units import format_bytes
from .costs import ChainCosts
from .forward_only import after_prefix, forward_only_length, planned_with_prefix, prefix_ops
from .ops import Backward, Fetch, Forward, Free, Op, Stash, Update
from .rotor_model import HELD, PLAN, SegmentNeeds
from .simulate import simulate
from .strategies import keep_all

TAPE = 0  # choice code of the tape option; a checkpoint option is coded by its j > a >= 0
_MAX_EXACT_CELLS = 1 << 24  # slots=None: refuse tables too large to hold in memory

Chooser = Callable[[int, int, int, int], int]  # (a, b, budget in units, kind) -> TAPE or j


class Infeasible(ValueError):
    """No rotor schedule fits the activation budget; ``smallest`` is the least that does."""

    def __init__(self, budget: int, smallest: int):
        self.budget = budget
        self.smallest = smallest
        super().__init__(
            f"activation budget {format_bytes(budget)} is below the smallest feasible "
            f"{format_bytes(smallest)} ({smallest} bytes) for this chain: raise the budget to "
            f"at least {format_bytes(smallest)}, or make the chain hold less (smaller batch, "
            f"more and smaller stages)")


def _shifted(values: np.ndarray, offset: int) -> np.ndarray:
    """out[..., m] = values[..., m - offset] (inf below ``offset``): a child's cost when its
    parent holds ``offset`` units."""
    out = np.full_like(values, np.inf)
    width = values.shape[-1]
    if offset < width:
        out[..., offset:] = values[..., : width - offset]
    return out


def _shifted_rows(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Row r of ``values`` shifted by ``offsets[r]``, as ``_shifted`` does for one row."""
    source = np.arange(values.shape[1])[None, :] - offsets[:, None]
    out = np.take_along_axis(values, np.maximum(source, 0), axis=1)
    out[source < 0] = np.inf
    return out


def _at_least(values: np.ndarray, need: int) -> np.ndarray:
    """``values`` with every budget below ``need`` made infeasible."""
    out = values.copy()
    out[: max(0, need)] = np.inf
    return out


def _time_table(model: SegmentNeeds, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """cost[kind, a, b, m]: least seconds for segment [a, b] of that kind within m units (inf
    when nothing fits), and choice[kind, a, b, m]: TAPE or the split j reaching it, for m in
    0..budget (one kind, standing for both, when nothing is stashable).

    Each segment is one numpy step over (split, m): its checkpoint options read the rows
    cost[PLAN, j, b] (j = a+1..b) and cost[kind, a, j-1], all computed at smaller spans."""
    length, width = model.length, budget + 1
    cost = np.full((model.kinds, length, length, width), np.inf)
    choice = np.full((model.kinds, length, length, width), TAPE, dtype=np.int32)
    memory = np.arange(width)
    later = min(PLAN, model.kinds - 1)
    for span in range(length):
        for a in range(length - span):
            b = a + span
            tape = np.full(width, model.fwd_time(a, a + 1) + model.finish_time[a])
            if a < b:
                child = cost[HELD, a + 1, b]
                if model.keeps_input(a + 1):
                    child = _at_least(child, model.keep_need(a + 1, b))
                tape = tape + _shifted(child, model.tape_hold(a))
            tape = _at_least(tape, model.tape_need(a, b))
            for kind in range(model.kinds):
                best = tape.copy()
                sweeps = np.array(model.sweep_needs(a, b, kind), dtype=np.int64)
                count = int(np.searchsorted(sweeps, budget, side="right"))  # sweeps only grow
                if count:
                    splits = np.arange(a + 1, a + 1 + count)
                    lingering = np.broadcast_to(model.lingering(splits, b), splits.shape)
                    cand = (model.fwd_time(a, splits)[:, None]
                            + _shifted(cost[later, a + 1: a + 1 + count, b],
                                       model.checkpoint_hold(a, kind))
                            + _shifted_rows(cost[kind, a, a: a + count], lingering))
                    cand[memory[None, :] < sweeps[:count, None]] = np.inf
                    row = cand.argmin(axis=0)
                    fastest = cand[row, memory]
                    better = fastest < best
                    best = np.where(better, fastest, best)
                    choice[kind, a, b, better] = splits[row[better]]
                cost[kind, a, b] = best
    return cost, choice


def _min_memory_table(model: SegmentNeeds) -> tuple[dict, dict]:
    """The least budget of each segment of each kind over all its rotor schedules (ties
    broken by time), and the choice reaching it: the same recurrences with max in place of
    the budget test."""
    best: dict[tuple[int, int, int], tuple[int, float]] = {}  # (need, seconds)
    choice: dict[tuple[int, int, int], int] = {}
    later = min(PLAN, model.kinds - 1)
    for span in range(model.length):
        for a in range(model.length - span):
            b = a + span
            base = model.fwd_time(a, a + 1) + model.finish_time[a]
            need, seconds = model.tape_need(a, b), base
            if a < b:
                child_need, child_time = best[HELD, a + 1, b]
                if model.keeps_input(a + 1):
                    child_need = max(child_need, model.keep_need(a + 1, b))
                need = max(need, child_need + model.tape_hold(a))
                seconds += child_time
            for kind in range(model.kinds):
                options = [((need, seconds), TAPE)]
                hold = model.checkpoint_hold(a, kind)
                for j, sweep in zip(range(a + 1, b + 1), model.sweep_needs(a, b, kind)):
                    (late_need, late_time) = best[later, j, b]
                    (early_need, early_time) = best[kind, a, j - 1]
                    options.append(((max(sweep, late_need + hold,
                                         early_need + model.lingering(j, b)),
                                     model.fwd_time(a, j) + late_time + early_time), j))
                best[kind, a, b], choice[kind, a, b] = min(options, key=lambda o: o[0])
    return best, choice


def _emit(model: SegmentNeeds, choose: Chooser, a: int, b: int, budget: int, ops: list[Op],
          kind: int = HELD) -> None:
    """Append the ops of segment [a, b] as ``choose(a, b, budget, kind)`` decides,
    recursively."""
    j = choose(a, b, budget, min(kind, model.kinds - 1))
    if j == TAPE:
        ops.append(Forward(a, tape=True))
        if model.frees_output(a, b):
            ops.append(Free(a + 1))
        if a < b:
            _emit(model, choose, a + 1, b, budget - model.tape_hold(a), ops, HELD)
        ops.append(Backward(a))
        if model.owned:
            ops.append(Update(a))
        return
    stash = model.stashes(a, kind)
    ops.append(Forward(a, tape=False))
    if stash:
        ops.append(Stash(a))
    for k in range(a + 1, j):
        ops += [Forward(k, tape=False), Free(k)]
    _emit(model, choose, j, b, budget - model.checkpoint_hold(a, kind), ops, PLAN)
    if stash:
        ops.append(Fetch(a))
    _emit(model, choose, a, j - 1, budget - model.lingering(j, b), ops, kind)


def _check_chain(costs: ChainCosts) -> None:
    if costs.length == 0:
        raise ValueError("rotor needs a chain of at least one stage")
    for i, stage in enumerate(costs.stages[1:], start=1):
        if not stage.input_grad:
            raise ValueError(f"stage {i} ({stage.name!r}) has input_grad=False, but the "
                             f"backward of stage {i - 1} needs grad[{i}]: only stage 0 may "
                             f"skip its input gradient")


_LEAST_MEMORY: OrderedDict[str, tuple[int, float, tuple[Op, ...]]] = OrderedDict()
LEAST_MEMORY_KEPT = 256  # chains whose least-memory schedule is remembered, the latest


def _min_memory(costs: ChainCosts) -> tuple[int, float, list[Op]]:
    """(smallest budget, its time, its ops): a least-memory rotor schedule, in exact bytes.
    Remembered per chain: a search asks it of the same costs for each plan and each
    smallest budget (the costs' notes and bandwidths do not enter it)."""
    key = repr(replace(costs, extra={}, bandwidths={}))
    if key in _LEAST_MEMORY:
        _LEAST_MEMORY.move_to_end(key)
        need, seconds, ops = _LEAST_MEMORY[key]
        return need, seconds, list(ops)
    found = _least_memory(costs)
    _LEAST_MEMORY[key] = (found[0], found[1], tuple(found[2]))
    if len(_LEAST_MEMORY) > LEAST_MEMORY_KEPT:
        _LEAST_MEMORY.popitem(last=False)
    return found


def _least_memory(costs: ChainCosts) -> tuple[int, float, list[Op]]:
    """``_min_memory`` computed."""
    model = SegmentNeeds(costs, unit=1)
    best, choice = _min_memory_table(model)
    last = model.length - 1
    need, seconds = best[HELD, 0, last]
    ops: list[Op] = []
    _emit(model, lambda a, b, _m, kind: choice[kind, a, b], 0, last, 0, ops)
    return int(max(need, model.keep_need(0, last))), float(seconds), ops


def _all_tape(costs: ChainCosts) -> list[Op]:
    """Keep-all as a rotor schedule: the tape option everywhere, so the loss (and any
    output its backward does not need) is freed before the backward that follows."""
    ops: list[Op] = []
    _emit(SegmentNeeds(costs, unit=1), lambda a, b, m, kind: TAPE, 0, costs.length - 1, 0, ops)
    return ops


def smallest_budget(costs: ChainCosts) -> int:
    """The least activation budget (bytes, static excluded) any rotor schedule fits in;
    ``rotor(costs, smallest_budget(costs))`` succeeds whatever ``slots``. A forward-only
    prefix (plan/forward_only.py) runs once before the schedule of the rest."""
    k = forward_only_length(costs)
    rest = after_prefix(costs, k) if k else costs
    _check_chain(rest)
    least = _min_memory(rest)[0] + rest.context_bytes
    return max(least, simulate(costs, prefix_ops(k)).peak) if k else least


def rotor(costs: ChainCosts, budget: int, *, slots: int | None = 500) -> list[Op]:
    """The fastest rotor schedule whose ``simulate(costs, ops).peak`` is <= ``budget``.

    ``budget`` is in bytes, static bytes excluded. With ``slots`` the table counts memory in
    ``ceil(budget / slots)``-byte units, every size rounded up, so the plan returned always
    fits, at the price of sometimes missing a faster one that fits only by a few bytes;
    ``slots=None`` counts exact bytes (small integer chains only). Raises Infeasible when no
    rotor schedule fits.

    The shared (tied) gradients are modelled exactly: they occupy memory from the last
    stage's backward to the end of the step, which the segments ending before the last
    stage see as part of their context. A forward-only prefix (plan/forward_only.py) runs
    once before the schedule of the rest.
    """
    k = forward_only_length(costs)
    if k and simulate(costs, prefix_ops(k)).peak > budget:
        raise Infeasible(budget, smallest_budget(costs))
    return planned_with_prefix(costs, lambda rest: _rotor(rest, budget, slots))


def _rotor(costs: ChainCosts, budget: int, slots: int | None) -> list[Op]:
    """``rotor`` on a chain whose every stage has a backward."""
    _check_chain(costs)
    if slots is not None and slots < 1:
        raise ValueError(f"slots={slots} must be a positive number of memory units, or None")
    smallest, least_time, least_ops = _min_memory(costs)
    if budget < smallest + costs.context_bytes:
        raise Infeasible(budget, smallest + costs.context_bytes)
    everything = _all_tape(costs)
    if simulate(costs, everything).peak <= budget:
        return everything  # every forward runs once: nothing can be faster
    budget -= costs.context_bytes  # resident for the whole step; the table counts the rest
    unit = 1 if slots is None else max(1, -(-budget // slots))
    units = budget // unit
    segments = costs.length * (costs.length + 1) // 2
    if slots is None and (units + 1) * segments > _MAX_EXACT_CELLS:
        raise ValueError(f"an exact table of {units + 1} bytes per segment is too large: "
                         f"pass slots= (e.g. 500) to count memory in coarser units")
    model = SegmentNeeds(costs, unit)
    cost, choice = _time_table(model, units)
    last = model.length - 1
    top = _at_least(cost[HELD, 0, last], model.keep_need(0, last))
    if not top[units] < least_time:
        return least_ops  # rounding hid every schedule faster than the least-memory one
    ops: list[Op] = []
    _emit(model, lambda a, b, m, kind: int(choice[kind, a, b, m]), 0, last, units, ops)
    return ops


def rotor_notes(costs: ChainCosts, ops: list[Op]) -> list[str]:
    """One or two sentences on what the schedule recomputes and the memory it saves."""
    counts = [0] * costs.length
    for op in ops:
        if isinstance(op, Forward):
            counts[op.stage] += 1
    extra = [i for i, n in enumerate(counts) if n > 1]
    sim, full = simulate(costs, ops), simulate(costs, keep_all(costs))
    if not extra:
        return [f"the budget holds every activation (peak {format_bytes(sim.peak)}): "
                f"nothing is recomputed"]
    names = ", ".join(costs.stages[i].name for i in extra[:6]) + (", ..." if extra[6:] else "")
    reruns = sum(counts[i] - 1 for i in extra)
    return [f"rotor recomputes {reruns} forward(s) of {len(extra)} stage(s) ({names}), "
            f"adding {(sim.time - full.time) * 1e3:.1f} ms to the step",
            f"activation peak {format_bytes(sim.peak)} instead of keep-all's "
            f"{format_bytes(full.peak)} (saves {format_bytes(full.peak - sim.peak)})"]
