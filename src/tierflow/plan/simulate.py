"""Replay a list of ops on a chain's costs: check it is valid, predict memory and time.

This is the single definition of what an op costs. The planners optimise against it, the
brute-force tests search against it, and the executor's ledger is checked against it.
Storages are reference counted exactly as the executor holds them: x[i] stays resident
while the plan references it (and has not stashed it on the tier below), while tape[i]
(which holds stage i's input) is alive, and while tape[i-1] (which holds stage i-1's
output) is alive. Stash and Fetch take no time here: the costs call a boundary stashable
only when its write and read hide behind compute, and count the bytes in flight as static.
Weight transfers (Load, Store, Drop) change no activation bytes here: the buffers that
streamed weights come into are static bytes of the costs (``plan/streaming.py``). A Load of
a stage's accumulated gradients (``plan/gradient_schedule.py``) holds them from then on:
its Backward adds to them rather than making new ones. Given ``unheld`` (per op, the bytes of
the static buffers of transfers it runs without: ``plan/buffer_windows.py``), each op holds
that much less.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import ChainCosts
from .forward_only import forward_only_length
from .gradient_schedule import GRADS
from .ops import TRANSFERS, Backward, Fetch, Forward, Free, Load, Op, Stash, Update


class InvalidPlan(ValueError):
    """An op needs a value the plan does not hold at that point."""


@dataclass(frozen=True)
class Event:
    op: str
    resident: int  # activation + gradient bytes held after the op
    peak: int  # the most held while it ran, transients included
    time: float  # seconds since the step began, at the end of the op


@dataclass(frozen=True)
class Simulation:
    timeline: tuple[Event, ...]
    peak: int  # activations, gradients and transients (static bytes excluded)
    time: float

    def total_peak(self, costs: ChainCosts) -> int:
        return self.peak + costs.static_bytes

    def growth(self) -> list[int]:
        """Per op: the most bytes it adds while it runs over what was held before it (the
        first op counted from nothing)."""
        held = [0] + [event.resident for event in self.timeline[:-1]]
        return [max(0, event.peak - before) for event, before in zip(self.timeline, held)]


class _State:
    def __init__(self, costs: ChainCosts):
        self.costs = costs
        self.x_sizes = [costs.x_bytes(i) for i in range(costs.length + 1)]
        self.x_refs: set[int] = {0}  # plan references to x[i]
        self.stashed: set[int] = set()  # referenced x[i] held on the tier below
        self.tapes: set[int] = set()
        self.grads: set[int] = set()  # grad[i] present
        self.param_grads: set[int] = set()  # stages whose parameter gradients exist
        self.read_grads: set[int] = set()  # stages whose gradients were read back early
        self.updated: set[int] = set()
        self.shared_grads = False
        self.first_backward = forward_only_length(costs)  # stages before it have none
        self.unheld = 0  # bytes of the static buffers the current op runs without

    def x_resident(self, i: int) -> bool:
        # tape[i] holds its input; tape[i-1] holds its output tensor (the executor keeps it
        # to start the stage's backward from), whether or not the backward reads its values
        in_memory = i in self.x_refs and i not in self.stashed
        return in_memory or i in self.tapes or i - 1 in self.tapes

    def drop_ref(self, i: int) -> None:
        self.x_refs.discard(i)
        self.stashed.discard(i)

    def resident(self) -> int:
        c = self.costs
        total = c.context_bytes - self.unheld
        total += sum(size for i, size in enumerate(self.x_sizes) if self.x_resident(i))
        total += sum(c.stages[i].tape for i in self.tapes)
        total += sum(self.x_sizes[i] for i in self.grads)
        if not c.grads_resident:  # else they are static bytes
            total += sum(c.stages[i].param_bytes for i in self.param_grads | self.read_grads)
            total += c.shared_grad_bytes if self.shared_grads else 0
        return total


def simulate(costs: ChainCosts, ops: list[Op] | tuple[Op, ...],
             unheld: Sequence[int] | None = None) -> Simulation:
    """Replay ``ops``; raise InvalidPlan if one needs a value that is not held. ``unheld``:
    per op, the bytes of the static buffers it runs without (None: it holds them all)."""
    state = _State(costs)
    length = costs.length
    events: list[Event] = []
    clock = 0.0
    peak = after = state.resident()
    for position, op in enumerate(ops):
        if unheld is not None and unheld[position] != state.unheld:
            state.unheld = unheld[position]
            after = state.resident()
        before = after  # what the last op left resident
        if isinstance(op, Forward):
            i = op.stage
            _check_stage(i, length, op)
            if i not in state.x_refs and i not in state.tapes:
                raise InvalidPlan(f"{op}: x[{i}] is not held")
            if i in state.stashed and i not in state.tapes:
                raise InvalidPlan(f"{op}: x[{i}] is on the tier below (no Fetch({i}) before)")
            s = costs.stages[i]
            new_out = 0 if state.x_resident(i + 1) else s.output_bytes
            if op.tape:
                if i in state.tapes:
                    raise InvalidPlan(f"{op}: tape[{i}] already exists")
                during = before + new_out + s.tape + s.fwd_transient
                state.tapes.add(i)
            else:
                during = before + new_out + s.fwd_transient_nograd
            state.x_refs.add(i + 1)
            clock += s.fwd_time
        elif isinstance(op, Backward):
            i = op.stage
            _check_stage(i, length, op)
            if i not in state.tapes:
                raise InvalidPlan(f"{op}: tape[{i}] does not exist (no Forward({i}, tape=True))")
            if i + 1 < length and i + 1 not in state.grads:
                raise InvalidPlan(f"{op}: grad[{i + 1}] does not exist yet")
            s = costs.stages[i]
            new_grads = 0 if i in state.param_grads | state.read_grads else s.param_bytes
            state.read_grads.discard(i)
            if i == length - 1 and not state.shared_grads:
                new_grads += costs.shared_grad_bytes
                state.shared_grads = True
            if costs.grads_resident:  # accumulated into gradients that exist already
                new_grads = 0
            out_grad = costs.x_bytes(i) if s.input_grad else 0
            during = before + out_grad + new_grads + s.bwd_transient
            state.tapes.discard(i)
            state.grads.discard(i + 1)
            state.drop_ref(i + 1)
            if i > 0:
                state.drop_ref(i)
            if s.input_grad:
                state.grads.add(i)
            state.param_grads.add(i)
            clock += s.bwd_time
        elif isinstance(op, Free):
            if op.index not in state.x_refs:
                raise InvalidPlan(f"{op}: x[{op.index}] is not held by the plan")
            if op.index in (0, length):
                raise InvalidPlan(f"{op}: x[{op.index}] belongs to the caller (the chain's "
                                  f"{'input' if op.index == 0 else 'output'}) and cannot be freed")
            state.drop_ref(op.index)
            during = before
        elif isinstance(op, Stash):
            if op.index not in costs.stashable:
                raise InvalidPlan(f"{op}: x[{op.index}] is not a stashable boundary of these "
                                  f"costs {list(costs.stashable)}")
            if op.index not in state.x_refs or op.index in state.stashed:
                raise InvalidPlan(f"{op}: x[{op.index}] is not held in memory by the plan")
            state.stashed.add(op.index)
            during = before
        elif isinstance(op, Fetch):
            if op.index not in state.stashed:
                raise InvalidPlan(f"{op}: x[{op.index}] is not on the tier below")
            state.stashed.discard(op.index)
            during = None  # what is resident after it
        elif isinstance(op, TRANSFERS):
            if isinstance(op, Load) and op.what == GRADS:
                _check_stage(op.stage, length, op)
                state.read_grads.add(op.stage)
            during = None  # what is resident after it
        elif isinstance(op, Update):
            i = op.stage
            _check_stage(i, length, op)
            if i not in state.param_grads or i in state.updated:
                raise InvalidPlan(f"{op}: stage {i} has no complete gradient to apply")
            s = costs.stages[i]
            during = before + s.update_transient
            state.param_grads.discard(i)
            state.updated.add(i)
            if i == state.first_backward:  # the lowest stage, updated last, owns tied params
                state.shared_grads = False
            clock += s.update_time
        else:
            raise InvalidPlan(f"unknown op {op!r}")
        after = state.resident()
        during = after if during is None else during
        peak = max(peak, during, after)
        events.append(Event(str(op), after, during, clock))
    return Simulation(tuple(events), peak, clock)


def check_complete(costs: ChainCosts, ops: list[Op] | tuple[Op, ...]) -> None:
    """Raise InvalidPlan unless ``ops`` is a whole training step: every stage after the
    forward-only prefix backpropagated exactly once, in reverse order, no tape left over,
    each of them updated if we own the optimizer."""
    first = forward_only_length(costs)
    backwards = [op.stage for op in ops if isinstance(op, Backward)]
    expected = list(range(costs.length - 1, first - 1, -1))
    if backwards != expected:
        raise InvalidPlan(f"backward order {backwards} must be {expected}")
    updates = sorted(op.stage for op in ops if isinstance(op, Update))
    if costs.optimizer_owned and updates != list(range(first, costs.length)):
        raise InvalidPlan(f"updates {updates} must cover every stage from {first} once")
    if not costs.optimizer_owned and updates:
        raise InvalidPlan("the plan updates parameters but tierflow does not own the optimizer")


def _check_stage(i: int, length: int, op: Op) -> None:
    if not 0 <= i < length:
        raise InvalidPlan(f"{op}: stage {i} is outside the chain of {length} stages")
