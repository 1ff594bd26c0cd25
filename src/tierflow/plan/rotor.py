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
The table holds C for every m in 0..budget; all segments of one span (b - a) are one numpy
step over their splits and all m at once, since each reads only segments of smaller spans.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..core.units import format_bytes
from .costs import ChainCosts
from .forward_only import after_prefix, forward_only_length, planned_with_prefix, prefix_ops
from .ops import Backward, Fetch, Forward, Free, Op, Stash, Update
from .rotor_model import HELD, PLAN, SegmentNeeds, needs_key
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


def _at_least(values: np.ndarray, need: int) -> np.ndarray:
    """``values`` with every budget below ``need`` made infeasible."""
    out = values.copy()
    out[: max(0, need)] = np.inf
    return out


@dataclass(frozen=True)
class _SpanTerms:
    """The terms of every segment [a, a + span] (arrays indexed by a) and of each of its
    splits j = a+1..a+span (indexed by (a, j - a - 1)): what both tables combine."""

    starts: np.ndarray  # a
    ends: np.ndarray  # b = a + span
    splits: np.ndarray  # j, (segments, span)
    later: int  # the kind of the later child [j, b]
    tape_need: np.ndarray
    tape_time: np.ndarray
    tape_hold: np.ndarray
    child_floor: np.ndarray  # the least a tape option's child [a+1, b] needs of its budget
    hold: list[np.ndarray]  # per kind: what x[a] costs the checkpoint option
    sweeps: list[np.ndarray]  # per kind: the checkpoint option's forwards' peak, per split
    lingering: np.ndarray  # what [j, b] leaves behind, per split
    sweep_time: np.ndarray  # seconds of the forwards a..j-1, per split

    @property
    def late(self) -> tuple[np.ndarray, np.ndarray]:
        """Index of the cells [j, b] of a (a, b) table, per split."""
        return self.splits, self.ends[:, None]

    @property
    def early(self) -> tuple[np.ndarray, np.ndarray]:
        """Index of the cells [a, j - 1] of a (a, b) table, per split."""
        return self.starts[:, None], self.splits - 1


def _span_terms(model: SegmentNeeds, span: int) -> _SpanTerms:
    """The terms of every segment of ``span``."""
    starts = np.arange(model.length - span)
    ends = starts + span
    splits = starts[:, None] + np.arange(1, span + 1)[None, :]  # (segments, span)
    return _SpanTerms(
        starts=starts, ends=ends, splits=splits, later=min(PLAN, model.kinds - 1),
        tape_need=np.array([model.tape_need(a, a + span) for a in starts], dtype=np.int64),
        tape_time=np.array([model.fwd_time(a, a + 1) + model.finish_time[a] for a in starts]),
        tape_hold=np.array([model.tape_hold(a) for a in starts], dtype=np.int64),
        child_floor=np.array([model.keep_need(a + 1, a + span)
                              if span and model.keeps_input(a + 1) else 0
                              for a in starts], dtype=np.int64),
        hold=[np.array([model.checkpoint_hold(a, kind) for a in starts], dtype=np.int64)
              for kind in range(model.kinds)],
        sweeps=[np.array([model.sweep_needs(a, a + span, kind) for a in starts],
                         dtype=np.int64).reshape(len(starts), span)
                for kind in range(model.kinds)],
        lingering=np.broadcast_to(model.lingering(splits, ends[:, None]), splits.shape),
        sweep_time=model.fwd_time(starts[:, None], splits))


def _time_table(model: SegmentNeeds, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """cost[kind, a, b, m]: least seconds for segment [a, b] of that kind within m units (inf
    when nothing fits), and choice[kind, a, b, m]: TAPE or the split j reaching it, for m in
    0..budget (one kind, standing for both, when nothing is stashable).

    All segments of one span are one numpy step over (segment, split, m): their checkpoint
    options read the rows cost[PLAN, j, b] and cost[kind, a, j-1], of smaller spans, each
    shifted right by what the parent holds meanwhile (a child given m - o units)."""
    length, width = model.length, budget + 1
    # each row is padded on the left with width infs: the row shifted right by o units
    # (inf below o) is then the window of width cells starting at width - o, a view
    padded = np.full((model.kinds, length, length, 2 * width), np.inf)
    cost = padded[..., width:]
    windows = sliding_window_view(padded, width, axis=-1)  # (kinds, a, b, start, m)

    def shifted(kind: int, a: np.ndarray, b: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """cost[kind, a, b, m - offsets] (inf below the offsets), index arrays broadcast."""
        return windows[kind, a, b, width - np.minimum(offsets, width)]

    choice = np.full((model.kinds, length, length, width), TAPE, dtype=np.int32)
    memory = np.arange(width)
    for span in range(length):
        t = _span_terms(model, span)
        starts, ends = t.starts, t.ends
        tape = np.repeat(t.tape_time[:, None], width, axis=1)  # (segments, m)
        if span:  # the child [a+1, b] gets m - tape_hold, and needs child_floor of it
            child = shifted(HELD, starts + 1, ends, t.tape_hold)
            child[memory[None, :] < (t.tape_hold + t.child_floor)[:, None]] = np.inf
            tape = tape + child
        tape[memory[None, :] < t.tape_need[:, None]] = np.inf
        for kind in range(model.kinds):
            best = tape.copy()
            if span:
                splits = t.splits  # (segments, splits)
                cand = (t.sweep_time[:, :, None]
                        + shifted(t.later, splits, ends[:, None], t.hold[kind][:, None])
                        + shifted(kind, starts[:, None], splits - 1, t.lingering))
                cand[memory[None, None, :] < t.sweeps[kind][:, :, None]] = np.inf
                row = cand.argmin(axis=1)  # (segments, m)
                fastest = np.take_along_axis(cand, row[:, None, :], axis=1)[:, 0, :]
                better = fastest < best
                best = np.where(better, fastest, best)
                choice[kind, starts, ends] = np.where(better, starts[:, None] + 1 + row, TAPE)
            cost[kind, starts, ends] = best
    return cost, choice


def _min_memory_table(model: SegmentNeeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """need[kind, a, b] and seconds[kind, a, b]: the least budget of each segment of each kind
    over all its rotor schedules (ties broken by time, then by the tape option and the
    earliest split), and choice[kind, a, b], the option reaching it: the same recurrences
    with max in place of the budget test, one numpy step per span."""
    shape = (model.kinds, model.length, model.length)
    need = np.zeros(shape, dtype=np.int64)
    seconds = np.zeros(shape)
    choice = np.full(shape, TAPE, dtype=np.int64)
    for span in range(model.length):
        t = _span_terms(model, span)
        starts, ends = t.starts, t.ends
        tape_need, tape_time = t.tape_need, t.tape_time
        if span:
            child_need = np.maximum(need[HELD, starts + 1, ends], t.child_floor)
            tape_need = np.maximum(tape_need, child_need + t.tape_hold)
            tape_time = tape_time + seconds[HELD, starts + 1, ends]
        for kind in range(model.kinds):
            need[kind, starts, ends], seconds[kind, starts, ends] = tape_need, tape_time
            if not span:
                continue
            late, early = (t.later,) + t.late, (kind,) + t.early
            cand_need = np.maximum.reduce([t.sweeps[kind],
                                           need[late] + t.hold[kind][:, None],
                                           need[early] + t.lingering])
            cand_time = t.sweep_time + seconds[late] + seconds[early]
            least = cand_need.min(axis=1)
            tied = np.where(cand_need == least[:, None], cand_time, np.inf)
            row = tied.argmin(axis=1)
            fastest = tied[np.arange(len(starts)), row]
            split = (least < tape_need) | ((least == tape_need) & (fastest < tape_time))
            need[kind, starts[split], ends[split]] = least[split]
            seconds[kind, starts[split], ends[split]] = fastest[split]
            choice[kind, starts[split], ends[split]] = (starts + 1 + row)[split]
    return need, seconds, choice


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


class _Remembered(OrderedDict):
    """The latest ``kept`` results of a function of a chain, least recently used dropped."""

    def __init__(self, kept: int):
        super().__init__()
        self.kept = kept

    def get_or_make(self, key: tuple, make: Callable[[], tuple]) -> tuple:
        if key in self:
            self.move_to_end(key)
            return self[key]
        self[key] = found = make()
        if len(self) > self.kept:
            self.popitem(last=False)
        return found


# a tier search plans each of a few hundred candidates, many with equal needs_key
_LEAST_MEMORY = _Remembered(kept=1024)  # needs_key -> (need, seconds, ops)
_FASTEST = _Remembered(kept=1024)  # (needs_key, context, budget, slots) -> (ops,)


def _min_memory(costs: ChainCosts) -> tuple[int, float, list[Op]]:
    """(smallest budget, its time, its ops): a least-memory rotor schedule, in exact bytes,
    the context left out. Remembered per ``needs_key``."""
    need, seconds, ops = _LEAST_MEMORY.get_or_make(
        needs_key(costs), lambda: _frozen(_least_memory(costs)))
    return need, seconds, list(ops)


def _frozen(found: tuple[int, float, list[Op]]) -> tuple[int, float, tuple[Op, ...]]:
    return found[0], found[1], tuple(found[2])


def _least_memory(costs: ChainCosts) -> tuple[int, float, list[Op]]:
    """``_min_memory`` computed."""
    model = SegmentNeeds(costs, unit=1)
    need, seconds, choice = _min_memory_table(model)
    last = model.length - 1
    ops: list[Op] = []
    _emit(model, lambda a, b, _m, kind: int(choice[kind, a, b]), 0, last, 0, ops)
    return (int(max(need[HELD, 0, last], model.keep_need(0, last))),
            float(seconds[HELD, 0, last]), ops)


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
    return planned_with_prefix(costs, lambda rest: _remembered_rotor(rest, budget, slots))


def _remembered_rotor(costs: ChainCosts, budget: int, slots: int | None) -> list[Op]:
    """``_rotor``, remembered per ``needs_key``, context bytes, budget and slots."""
    key = (needs_key(costs), costs.context_bytes, budget, slots)
    return list(_FASTEST.get_or_make(key, lambda: (tuple(_rotor(costs, budget, slots)),))[0])


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
