"""Where a plan moves the weights of its streamed stages: ``Load``, ``Store`` and ``Drop`` ops
placed among its compute ops, so that the executor only dispatches them.

Pure data. The stages in ``StreamedWeights`` keep their weights on a lower tier between
uses. Before each compute op its stage's weights are loaded if they are not in memory (a
read on demand), and the next ``depth`` streamed stages the ops use after it are loaded
ahead, so that their reads overlap it. After an op, a stage's weights are:
- stored back after their update inside the backward, and dropped once written, unless the
  stage is among the next ``depth`` + 1 streamed stages used counting on into the next
  step (the stages updated last are the first the next forward runs: their reads would
  have no compute beside them, so they stay, in the buffers reading ahead uses);
- dropped after an update the optimizer ran on their copy in host RAM (stale here), and
  after any other op, unless the stage's tape is in memory (it holds them, unless the
  forward was selective) or the stage is
  the next streamed one used (its next op follows at once).

The ops of one micro-batch run from the step's boundary state (what is in memory between
steps) to the state at the end of its backward; ``between`` loads the boundary state back
after it, ``update_pass`` updates every stage after the backward (deferred updates) and
``after_pass`` loads the boundary state after that pass; ``cold`` loads it from nothing (the
first step, after a failed one), and ``evaluation`` runs every stage forward from the
boundary state back to it. One ``WeightSchedule`` holds them all.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .ops import WEIGHTS, Backward, Drop, Forward, Load, Op, Store, Update, stage_of
from .tape_schedule import tapes_below


@dataclass(frozen=True)
class StreamedWeights:
    """The stages whose weights live on a lower tier, and how they move.

    ``sizes``: (stage, bytes of its weights, bytes of its trainable ones) per streamed stage
    (a Load reads them all, a Store writes the trainable ones back); ``home`` the tier they live
    on and ``compute`` the tier they are used on; ``read`` and ``write`` the resources that
    carry them; ``written_back``: updates inside the backward change them (else the update
    pass does); ``host_updated``: stages the optimizer steps in host RAM, whose copy on the
    compute tier is stale after the update; ``tapes_below``: stages whose tapes wait on a
    lower tier (they do not hold the weights)."""

    sizes: tuple[tuple[int, int, int], ...]
    home: str
    compute: str
    read: str
    write: str
    depth: int
    written_back: bool = True
    host_updated: frozenset[int] = frozenset()
    tapes_below: frozenset[int] = frozenset()

    @property
    def stages(self) -> dict[int, int]:
        """Per streamed stage, the bytes of its weights."""
        return {i: read for i, read, _ in self.sizes}

    @property
    def trainable(self) -> dict[int, int]:
        """Per streamed stage, the bytes of its trainable weights (what a Store writes)."""
        return {i: written for i, _, written in self.sizes}

    def to_dict(self) -> dict:
        return {"sizes": [list(pair) for pair in self.sizes], "home": self.home,
                "compute": self.compute, "read": self.read, "write": self.write,
                "depth": self.depth, "written_back": self.written_back,
                "host_updated": sorted(self.host_updated),
                "tapes_below": sorted(self.tapes_below)}

    @classmethod
    def from_dict(cls, data: dict) -> "StreamedWeights":
        return cls(sizes=tuple((int(i), int(r), int(w)) for i, r, w in data["sizes"]),
                   home=data["home"],
                   compute=data["compute"], read=data["read"], write=data["write"],
                   depth=int(data["depth"]), written_back=bool(data["written_back"]),
                   host_updated=frozenset(data["host_updated"]),
                   tapes_below=frozenset(data["tapes_below"]))


@dataclass(frozen=True)
class WeightSchedule:
    """Every op list that moves streamed weights, each with its transfers in place."""

    step: tuple[Op, ...]  # one micro-batch: boundary state -> end of its backward
    between: tuple[Op, ...]  # end of the backward -> boundary state
    update_pass: tuple[Op, ...]  # deferred updates, end of the backward -> end of the pass
    after_pass: tuple[Op, ...]  # end of the update pass -> boundary state
    cold: tuple[Op, ...]  # nothing in memory -> boundary state
    evaluation: tuple[Op, ...]  # every stage forward, boundary state -> boundary state
    boundary: frozenset[int]  # the streamed stages in memory between steps


def schedule_weights(ops: Sequence[Op], streamed: StreamedWeights, length: int,
                     update_order: Sequence[int] = ()) -> WeightSchedule:
    """The weight transfers of a plan's compute ``ops`` (a chain of ``length`` stages) placed
    among them; ``update_order``: the stages the update pass steps, in its order (when
    updates are deferred: not ``streamed.written_back``). Runs the steps
    until the boundary state repeats."""
    boundary: frozenset[int] = frozenset()
    for _ in range(4):  # the boundary state is reached by the second step
        step, end = _step(ops, streamed, boundary)
        between, after = _between(ops, streamed, end)
        if after == boundary:
            break
        boundary = after
    else:
        raise ValueError("the weight transfers of these ops never repeat from step to step")
    update_pass: tuple[Op, ...] = ()
    after_pass: tuple[Op, ...] = ()
    if not streamed.written_back:  # updates deferred to a pass (stepping ``update_order``)
        update_pass, passed = _update_pass(update_order, streamed, end)
        after_pass = tuple(_loads(_in_order_of_use(ops, boundary - passed), streamed))
    evaluation = _evaluation(length, streamed, boundary, ops)
    cold = tuple(_loads(_in_order_of_use(ops, boundary), streamed))
    return WeightSchedule(step, between, update_pass, after_pass, cold, evaluation, boundary)


def check_schedule(schedule: WeightSchedule, streamed: StreamedWeights) -> None:
    """ValueError unless every op list finds the weights its ops use in memory, reads only
    what is not, and leaves memory as the next list starts it: the step and ``between``,
    the step and the update pass and ``after_pass``, and the evaluation, each from the
    boundary state back to it; ``cold`` from nothing to it."""
    stages = streamed.stages

    def replay(ops: Sequence[Op], state: frozenset[int], name: str) -> frozenset[int]:
        resident = set(state)
        for op in ops:
            if isinstance(op, (Load, Store, Drop)) and op.what != WEIGHTS:
                continue
            if isinstance(op, Load):
                if op.stage in resident:
                    raise ValueError(f"{name}: {op} reads weights that are in memory")
                resident.add(op.stage)
            elif isinstance(op, Drop) or (isinstance(op, Store) and not op.keep):
                resident.discard(op.stage)
            elif isinstance(op, Update) and op.on_host:
                continue  # the host optimizer steps its host copy
            elif stage_of(op) in stages and stage_of(op) not in resident:
                raise ValueError(f"{name}: {op} runs without its stage's weights in memory")
        return frozenset(resident)

    boundary = schedule.boundary
    if replay(schedule.cold, frozenset(), "cold") != boundary:
        raise ValueError("cold does not read the boundary state")
    end = replay(schedule.step, boundary, "step")
    if replay(schedule.between, end, "between") != boundary:
        raise ValueError("between does not end at the boundary state")
    if not streamed.written_back:
        passed = replay(schedule.update_pass, end, "update pass")
        if replay(schedule.after_pass, passed, "after pass") != boundary:
            raise ValueError("the update pass does not end at the boundary state")
    if replay(schedule.evaluation, boundary, "evaluation") != boundary:
        raise ValueError("the evaluation does not end at the boundary state")


class _Memory:
    """The streamed stages in memory (read or being read) and the transfers emitted."""

    def __init__(self, streamed: StreamedWeights, resident: Iterable[int]) -> None:
        self.streamed = streamed
        self.sizes = streamed.stages
        self.resident = set(resident)
        self.out: list[Op] = []

    def load(self, i: int) -> None:
        if i in self.sizes and i not in self.resident:
            s = self.streamed
            self.out.append(Load(WEIGHTS, i, s.home, s.compute, s.read, self.sizes[i]))
            self.resident.add(i)

    def store(self, i: int, keep: bool) -> None:
        s = self.streamed
        self.out.append(Store(WEIGHTS, i, s.compute, s.home, s.write, s.trainable[i], keep))
        if not keep:
            self.resident.discard(i)

    def drop(self, i: int) -> None:
        self.out.append(Drop(WEIGHTS, i, self.streamed.compute))
        self.resident.discard(i)


def _step(ops: Sequence[Op], streamed: StreamedWeights,
          start: frozenset[int]) -> tuple[tuple[Op, ...], frozenset[int]]:
    """One micro-batch's ops with their transfers, from ``start``; the state at its end."""
    memory = _Memory(streamed, start)
    stages = streamed.stages
    below = tapes_below(ops, streamed.tapes_below)  # forwards whose tapes go down
    taped: set[int] = set()  # stages whose tape is in memory
    for position, op in enumerate(ops):
        i = stage_of(op)
        memory.load(i)
        for j in _ahead(ops[position + 1:], streamed, running=i):
            memory.load(j)
        memory.out.append(op)
        # a selective tape keeps no weights: its recomputation reads them after their Load
        if isinstance(op, Forward) and op.tape and not op.selective and position not in below:
            taped.add(op.stage)
        elif isinstance(op, Backward):
            taped.discard(op.stage)
        if i not in stages:
            continue
        if isinstance(op, Update) and i in streamed.host_updated:
            memory.drop(i)
        elif isinstance(op, Update) and streamed.written_back:
            memory.store(i, keep=_kept_across_steps(ops, position, streamed))
        elif i not in taped and _next_use(ops, position, i) != _next_streamed(ops, position,
                                                                              stages):
            memory.drop(i)
    return tuple(memory.out), frozenset(memory.resident)


def _between(ops: Sequence[Op], streamed: StreamedWeights,
             state: frozenset[int]) -> tuple[tuple[Op, ...], frozenset[int]]:
    """The reads that start the next step from ``state``: the first ``depth`` streamed
    stages it uses besides the first one, when that one is in memory already."""
    first = next((j for op in ops if (j := stage_of(op)) in streamed.stages), None)
    memory = _Memory(streamed, state)
    for j in _ahead(ops, streamed, running=first if first in state else None):
        memory.load(j)
    return tuple(memory.out), frozenset(memory.resident)


def _update_pass(order: Sequence[int], streamed: StreamedWeights,
                 state: frozenset[int]) -> tuple[tuple[Op, ...], frozenset[int]]:
    """The update pass in ``order``: each streamed stage loaded for its update (if not in
    memory), the next ``depth`` stages of the order loaded while it updates, and stored
    back after it; the stages stepped in host RAM (``host_updated``) neither."""
    memory = _Memory(streamed, state)
    host = streamed.host_updated  # stepped in host RAM: their weights stay where they are
    on_tier = [i for i in order if i not in host]
    for i in order:
        if i in host:
            memory.out.append(Update(i))
            continue
        memory.load(i)
        position = on_tier.index(i)
        for j in on_tier[position + 1:position + 1 + streamed.depth]:
            memory.load(j)
        memory.out.append(Update(i))
        if i in streamed.stages:
            memory.store(i, keep=False)
    return tuple(memory.out), frozenset(memory.resident)


def _evaluation(length: int, streamed: StreamedWeights, boundary: frozenset[int],
                step: Sequence[Op]) -> tuple[Op, ...]:
    """Every stage forward without a tape, from the boundary state, each stage's weights
    dropped after its use; then the boundary state back (what it lacks read, what it does
    not hold dropped)."""
    ops = [Forward(i, tape=False) for i in range(length)]
    memory = _Memory(streamed, boundary)
    for position, op in enumerate(ops):
        memory.load(op.stage)
        for j in _ahead(ops[position + 1:], streamed, running=op.stage):
            memory.load(j)
        memory.out.append(op)
        if op.stage in streamed.stages and _next_use(ops, position, op.stage) != \
                _next_streamed(ops, position, streamed.stages):
            memory.drop(op.stage)
    for j in sorted(memory.resident - boundary):
        memory.drop(j)
    for j in _in_order_of_use(step, boundary - memory.resident):
        memory.load(j)
    return tuple(memory.out)


def _loads(stages: Sequence[int], streamed: StreamedWeights) -> list[Op]:
    memory = _Memory(streamed, ())
    for i in stages:
        memory.load(i)
    return memory.out


def _in_order_of_use(ops: Sequence[Op], stages: Iterable[int]) -> list[int]:
    wanted = set(stages)
    ordered: list[int] = []
    for op in ops:
        i = stage_of(op)
        if i in wanted and i not in ordered:
            ordered.append(i)
    return ordered + sorted(wanted - set(ordered))


def _ahead(ops: Sequence[Op], streamed: StreamedWeights, running: int | None) -> list[int]:
    """The first ``depth`` streamed stages ``ops`` use besides ``running``."""
    upcoming: list[int] = []
    if streamed.depth == 0:
        return upcoming
    stages = streamed.stages
    for op in ops:
        j = stage_of(op)
        if j in stages and j != running and j not in upcoming:
            upcoming.append(j)
            if len(upcoming) == streamed.depth:
                break
    return upcoming


def _kept_across_steps(ops: Sequence[Op], position: int, streamed: StreamedWeights) -> bool:
    """Whether the stage of ``ops[position]`` (an update) is among the next ``depth`` + 1
    streamed stages the ops use, counting on into the next step (the same ops run again)."""
    i = stage_of(ops[position])
    stages = streamed.stages
    upcoming: list[int] = []
    for op in (*ops[position + 1:], *ops[:position + 1]):
        j = stage_of(op)
        if j in stages and j not in upcoming:
            if j == i:
                return True
            upcoming.append(j)
            if len(upcoming) > streamed.depth:
                return False
    return False


def _next_use(ops: Sequence[Op], position: int, i: int) -> int | None:
    return next((k for k in range(position + 1, len(ops)) if stage_of(ops[k]) == i), None)


def _next_streamed(ops: Sequence[Op], position: int, stages: dict[int, int]) -> int | None:
    return next((k for k in range(position + 1, len(ops)) if stage_of(ops[k]) in stages), None)
