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

Memory of a segment. The bytes a segment "owns" are x[a], grad[b+1] and everything created
while it runs; its context (outer checkpoints and tapes, the parameter gradients of stages
> b, ...) stays constant while it runs. ``m`` below is the budget left for the owned bytes,
and a schedule is feasible for ``m`` when every op's peak (as ``simulate()`` counts it:
resident bytes plus the op's new outputs plus its transient) minus the context is <= m.
With X = x bytes, T = tape, g = gradient of an x, P = parameter gradients, tr = transients,
lin(j, b) = what [j, b] leaves behind besides g[j] (P of j..b unless updated at once, plus
the shared gradients when b = L-1), the needs are:

  tape option, own ops:  Forward(a):  X[a] + g[b+1] + X[a+1] + T[a] + tr_fwd[a]
                         Backward(a): X[a] + T[a] + g[a+1] + X[a+1]*out_in_tape[a]
                                      + lin(a+1, b)*(a < b) + g[a] + P[a]
                                      + shared*(a == L-1) + tr_bwd[a]
                         Update(a):   g[a] + P[a] + shared*(b == L-1) + tr_upd[a]
                                      (+ X[a] when x[a] outlives the segment, see below)
                child [a+1, b] gets m - X[a] - T[a]
  checkpoint option:     Forward(k): X[a] + g[b+1] + X[k]*(k > a) + X[k+1] + tr_nograd[k]
                child [j, b] gets m - X[a]; child [a, j-1] gets m - lin(j, b)

x[a] outlives its segment when a == 0 (the caller's input) or when the tape of stage a-1
keeps it (output_in_tape), which only matters to Update(a); every schedule of [a, b] ends
with the same Update(a) need, so "x[a] outlives" is one extra threshold on the whole
segment (``_Model.keep_need``), not a second table.

Stashed boundaries. When the costs call x[a] stashable (``ChainCosts.stashable``) and only
the plan holds it, the checkpoint option may keep it on the tier below while it is not
needed: Forward(a) ; Stash(a) ; the other forwards ; solve [j, b] ; Fetch(a) ; solve
[a, j-1]. Then x[a] costs nothing after Forward(a) (the sweep's later forwards and child
[j, b] get m instead of m - X[a]). Whether only the plan holds x[a] depends on the parent,
so the tables have two kinds of segment: HELD (x[a] is the caller's x[0], or tape[a-1]
holds it: the child of a tape option) and PLAN (x[a] was made by a forward without tape:
the later child [j, b] of a checkpoint option). The early child [a, j-1] is of its
parent's kind. Without stashable boundaries the two tables are the same.

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

from typing import Callable, Union

import numpy as np

from ..units import format_bytes
from .costs import ChainCosts
from .ops import Backward, Fetch, Forward, Free, Op, Stash, Update
from .simulate import simulate
from .strategies import keep_all

TAPE = 0  # choice code of the tape option; a checkpoint option is coded by its j > a >= 0
HELD, PLAN = 0, 1  # segment kinds: x[a] held by more than the plan, or by the plan alone
_MAX_EXACT_CELLS = 1 << 24  # slots=None: refuse tables too large to hold in memory

Chooser = Callable[[int, int, int, int], int]  # (a, b, budget in units, kind) -> TAPE or j
Index = Union[int, np.ndarray]  # one stage index, or an array of them (vectorised splits)


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


class _Model:
    """The chain's byte terms rounded up to whole ``unit``s, and the memory needs of the
    steps of a rotor schedule, measured against the segment's own budget (module docstring).

    Rounding every term up means a plan that fits in units fits in bytes too: each op's
    true peak is a sum of terms, each at most ``unit`` times its rounded value.
    """

    def __init__(self, costs: ChainCosts, unit: int):
        def up(n: int) -> int:
            return -(-n // unit)

        stages = costs.stages
        self.length = costs.length
        self.owned = costs.optimizer_owned
        self.x = [up(costs.x_bytes(i)) for i in range(self.length + 1)]
        self.tape = [up(s.tape) for s in stages]
        # the executor keeps each taped stage's output tensor until its backward (the
        # simulator's rule), so for memory every output counts as held by its tape
        self.out_in_tape = [True for _ in stages]
        self.tr_fwd = [up(s.fwd_transient) for s in stages]
        self.tr_nograd = [up(s.fwd_transient_nograd) for s in stages]
        self.tr_bwd = [up(s.bwd_transient) for s in stages]
        self.tr_upd = [up(s.update_transient) for s in stages]
        # bytes of the parameter gradients each backward makes (none when they are resident
        # all step: accumulated into, and counted in the static bytes)
        self.params = [0 if costs.grads_resident else up(s.param_bytes) for s in stages]
        self.shared = 0 if costs.grads_resident else up(costs.shared_grad_bytes)
        # g[i]: gradient of x[i], made by Backward(i); the loss x[L] gets none.
        self.grad = [self.x[i] if s.input_grad else 0 for i, s in enumerate(stages)] + [0]
        self._fwd_prefix = np.concatenate([[0.0], np.cumsum([s.fwd_time for s in stages])])
        self.finish_time = [s.bwd_time + (s.update_time if self.owned else 0.0)
                            for s in stages]
        self._param_prefix = np.concatenate([[0], np.cumsum(self.params, dtype=np.int64)])
        self.stashable = [i in costs.stashable for i in range(self.length + 1)]
        self.kinds = 2 if any(self.stashable) else 1  # one table serves both kinds without

    def stashes(self, a: int, kind: int) -> bool:
        """Whether the checkpoint option of a segment of this kind stashes x[a]."""
        return kind == PLAN and self.stashable[a]

    def checkpoint_hold(self, a: int, kind: int) -> int:
        """What x[a] costs the checkpoint option after Forward(a): nothing when stashed."""
        return 0 if self.stashes(a, kind) else self.x[a]

    def fwd_time(self, a: int, j: Index) -> Index:
        """Seconds of the forwards of stages a..j-1 (per element for an array of j)."""
        return self._fwd_prefix[j] - self._fwd_prefix[a]

    def lingering(self, j: Index, b: int) -> Index:
        """What solving [j, b] leaves resident besides g[j]: the parameter gradients of
        stages j..b (none when each is updated and freed right away) and, once the last
        stage's backward has run, the shared gradients (they live until Update(0))."""
        params = 0 if self.owned else self._param_prefix[b + 1] - self._param_prefix[j]
        return params + (self.shared if b == self.length - 1 else 0)

    def update_need(self, a: int, b: int) -> int:
        """Peak of Update(a) at the end of [a, b], when x[a] does not outlive it."""
        if not self.owned:
            return 0
        last = self.shared if b == self.length - 1 else 0
        return self.grad[a] + self.params[a] + last + self.tr_upd[a]

    def keep_need(self, a: int, b: int) -> int:
        """The budget [a, b] needs at least when x[a] outlives it (it is then resident
        during Update(a)); 0 without an optimizer step."""
        return self.x[a] + self.update_need(a, b) if self.owned else 0

    def keeps_input(self, a: int) -> bool:
        """Whether x[a] outlives a segment that starts at a as the child of a tape option
        (stage a-1's tape holds it) or at the top (x[0] belongs to the caller)."""
        return a == 0 or self.out_in_tape[a - 1]

    def frees_output(self, a: int, b: int) -> bool:
        """Whether the tape option drops x[a+1] right after Forward(a): in a one-stage
        segment nothing forwards from it again, and unless stage a's tape keeps it the
        backward does not need it (only grad[a+1])."""
        return a == b and not self.out_in_tape[a]

    def tape_need(self, a: int, b: int) -> int:
        """Peak of the tape option's own ops (Forward(a), Backward(a), Update(a)).

        At Backward(a), x[a+1] is resident only through the tape (output_in_tape): for
        a < b the child's Backward(a+1) dropped the plan's reference, for a == b the
        Free right after Forward(a) did. The shared gradients appear at Backward(L-1).
        """
        x, g = self.x, self.grad
        forward = x[a] + g[b + 1] + x[a + 1] + self.tape[a] + self.tr_fwd[a]
        made_before = self.lingering(a + 1, b) if a < b else 0
        shared_now = self.shared if a == self.length - 1 else 0
        backward = (x[a] + self.tape[a] + g[a + 1] + x[a + 1] * self.out_in_tape[a]
                    + made_before + g[a] + self.params[a] + shared_now + self.tr_bwd[a])
        return max(forward, backward, self.update_need(a, b))

    def sweep_needs(self, a: int, b: int, kind: int) -> list[int]:
        """needs[j - a - 1]: peak of the no-tape forwards a..j-1 of the checkpoint option
        with split j, for j = a+1..b (a running maximum over the forwards)."""
        needs, peak = [], 0
        for k in range(a, b):
            x_a = self.x[a] if k == a else self.checkpoint_hold(a, kind)
            held = x_a + self.grad[b + 1] + (self.x[k] if k > a else 0)
            peak = max(peak, held + self.x[k + 1] + self.tr_nograd[k])
            needs.append(peak)
        return needs

    def tape_hold(self, a: int) -> int:
        """What the tape option holds while its child [a+1, b] runs: x[a] and tape[a]."""
        return self.x[a] + self.tape[a]


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


def _time_table(model: _Model, budget: int) -> tuple[np.ndarray, np.ndarray]:
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


def _min_memory_table(model: _Model) -> tuple[dict, dict]:
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


def _emit(model: _Model, choose: Chooser, a: int, b: int, budget: int, ops: list[Op],
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


def _min_memory(costs: ChainCosts) -> tuple[int, float, list[Op]]:
    """(smallest budget, its time, its ops): a least-memory rotor schedule, in exact bytes."""
    model = _Model(costs, unit=1)
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
    _emit(_Model(costs, unit=1), lambda a, b, m, kind: TAPE, 0, costs.length - 1, 0, ops)
    return ops


def smallest_budget(costs: ChainCosts) -> int:
    """The least activation budget (bytes, static excluded) any rotor schedule fits in;
    ``rotor(costs, smallest_budget(costs))`` succeeds whatever ``slots``."""
    _check_chain(costs)
    return _min_memory(costs)[0] + costs.context_bytes


def rotor(costs: ChainCosts, budget: int, *, slots: int | None = 500) -> list[Op]:
    """The fastest rotor schedule whose ``simulate(costs, ops).peak`` is <= ``budget``.

    ``budget`` is in bytes, static bytes excluded. With ``slots`` the table counts memory in
    ``ceil(budget / slots)``-byte units, every size rounded up, so the plan returned always
    fits, at the price of sometimes missing a faster one that fits only by a few bytes;
    ``slots=None`` counts exact bytes (small integer chains only). Raises Infeasible when no
    rotor schedule fits.

    The shared (tied) gradients are modelled exactly: they occupy memory from the last
    stage's backward to the end of the step, which the segments ending before the last
    stage see as part of their context.
    """
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
    model = _Model(costs, unit)
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
