"""When each op of a plan runs: its ops as a task graph on the resources that carry them,
the one price of a step that the planner chooses by and a trace shows beside the measured.

Pure data. One dispatcher walks the ops in order, as the executor does:
- a compute op (Forward, Backward, Update) runs on ``compute`` once the dispatcher reaches
  it, the compute resource is free and what it waits for is done; the dispatcher waits for
  its end (the executor's thread runs it). An Update that names the host optimizer runs
  there only its hand-over (``update_time``; its gradients come down by the plan's Store
  of them, which it waits for); the host
  optimizer then steps it (``host_update_time``) once its step before is done, and the
  dispatcher waits until then (one step queued behind the running one); at ``join`` (the
  end of the backward) it waits for every step of the host optimizer;
- a Load or Store starts on its own resource (an I/O thread, a copy stream), queued behind
  that resource's earlier transfers (and those of the resources that share its device: a
  disk's reads and writes take turns, ``SHARED_DEVICE``), once the dispatcher reaches it
  and what it waits for is done, and takes its bytes over the resource's bandwidth
  (``ChainCosts.bandwidths``); the dispatcher goes on at once;
- a Reduce or a Gather starts on its resource (the network) as a Store does, queued
  behind the network's earlier collectives; an Exchange too, and the dispatcher waits for
  its end (what it returns decides what runs next);
- a Drop waits (on the dispatcher) for the stage's Store in flight, and the Store of a
  tape, a checkpoint or a stage's gradients for the Store of the one before it (the
  executor writes one of each at a time); a Fetch waits (on the dispatcher) for its
  checkpoint's Load; Free and Stash take no time.
What an op waits for: a compute op of a streamed stage, the last Load of its weights; an
Update also the last Store of its weights (a kept stage's write reads them) and the last
Load of its optimizer states; a Backward the Load of its tape (when it went down); a
Backward and an Update the last Load of their stage's gradients (deferred updates), an
Update in host RAM also the last Store of them (copied down for it); an Update and a
Store of a stage's gradients, the stage's Reduce; a Load, the last Store of the same
tensors (read only once written), and one ``after_store`` the last Store of any stage's
(the executor reads into the buffer that write frees). The same ops run step after step,
so a step's time is the steady state's: the dispatcher's time over one repetition after
two.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import ChainCosts
from .ops import (
    COMPUTE,
    HOST_OPTIMIZER,
    WEIGHTS,
    Backward,
    Drop,
    Exchange,
    Fetch,
    Forward,
    Gather,
    Load,
    Op,
    Reduce,
    Store,
    Update,
)
from .state_schedule import STATES
from .streaming import SHARED_DEVICE
from .tape_schedule import TAPE
from .boundary_schedule import BOUNDARY
from .gradient_schedule import GRADS

ONE_WRITE_AT_A_TIME = (TAPE, BOUNDARY, GRADS)  # a Store of these waits for the one before
WARM_UP = 2  # repetitions before the one that is measured


@dataclass(frozen=True)
class Span:
    """One op's run: its position in the ops, its resource, its start and end (seconds
    since the measured repetition began)."""

    position: int
    name: str
    resource: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    spans: tuple[Span, ...]  # the measured repetition's ops that take time
    time: float  # seconds of one repetition in the steady state

    def busy(self, resource: str) -> float:
        """Seconds ``resource`` works in one repetition."""
        return sum(s.end - s.start for s in self.spans if s.resource == resource)


def timeline(costs: ChainCosts, ops: Sequence[Op], join: int | None = None) -> Timeline:
    """``ops`` run over and over (a step's ops and the transfers between steps), priced on
    ``costs``: the steady state's time of one repetition and when each op ran in it.
    ``join``: the position (default: the end of ``ops``) before which the dispatcher waits
    for every step of the host optimizer (the end of a backward)."""
    join = len(ops) if join is None else join
    clock = 0.0  # the dispatcher's time
    free: dict[str, float] = {}  # resource (or the device it shares) -> when its last op ends
    loaded: dict[tuple[str, int], float] = {}  # (what, stage) -> when its last Load ends
    stored: dict[tuple[str, int], float] = {}  # (what, stage) -> when its last Store ends
    reduced: dict[int, float] = {}  # stage -> when its last Reduce ends
    spans: list[Span] = []
    written: dict[str, float] = {}  # what -> when its last Store (of any stage) ends
    start = 0.0
    for repetition in range(WARM_UP + 1):
        measured = repetition == WARM_UP
        if measured:
            start = clock
        for position, op in enumerate((*ops, None)):
            if position == join:
                clock = max(clock, free.get(HOST_OPTIMIZER, 0.0))
            if op is None:
                break
            host = None  # the host optimizer's span of an Update it runs
            if isinstance(op, (Forward, Backward, Update)):
                stage = costs.stages[op.stage]
                seconds = stage.fwd_time if isinstance(op, Forward) else \
                    stage.bwd_time if isinstance(op, Backward) else stage.update_time
                ready = max(clock, free.get(COMPUTE, 0.0), loaded.get((WEIGHTS, op.stage), 0.0))
                if not isinstance(op, Forward):
                    ready = max(ready, loaded.get((GRADS, op.stage), 0.0))
                if isinstance(op, Update):
                    ready = max(ready, stored.get((WEIGHTS, op.stage), 0.0),
                                loaded.get((STATES, op.stage), 0.0), reduced.get(op.stage, 0.0))
                if isinstance(op, Update) and op.on_host:  # its gradients down in host RAM
                    ready = max(ready, stored.get((GRADS, op.stage), 0.0))
                elif isinstance(op, Backward):
                    ready = max(ready, loaded.get((TAPE, op.stage), 0.0))
                clock = free[COMPUTE] = ready + seconds
                span = Span(position, str(op), COMPUTE, ready, clock)
                if isinstance(op, Update) and op.on_host:  # handed over once the one before
                    clock = max(clock, free.get(HOST_OPTIMIZER, 0.0))  # it is done
                    free[HOST_OPTIMIZER] = clock + stage.host_update_time
                    host = Span(position, str(op), HOST_OPTIMIZER, clock,
                                free[HOST_OPTIMIZER])
            elif isinstance(op, (Load, Store)):
                serial = isinstance(op, Store) and op.what in ONE_WRITE_AT_A_TIME
                if serial:
                    clock = max(clock, written.get(op.what, 0.0))
                key = (op.what, op.stage)
                after = stored.get(key, 0.0) if isinstance(op, Load) else \
                    reduced.get(op.stage, clock) if op.what == GRADS else clock
                if isinstance(op, Load) and op.after_store:
                    after = max(after, written.get(op.what, 0.0))
                lane = SHARED_DEVICE.get(op.resource, op.resource)
                ready = max(clock, free.get(lane, 0.0), after)
                end = free[lane] = ready + op.nbytes / costs.bandwidths[op.resource]
                (loaded if isinstance(op, Load) else stored)[key] = end
                if isinstance(op, Store):
                    written[op.what] = max(written.get(op.what, 0.0), end)
                span = Span(position, str(op), op.resource, ready, end)
            elif isinstance(op, (Reduce, Gather, Exchange)):
                ready = max(clock, free.get(op.resource, 0.0))
                end = free[op.resource] = ready + op.nbytes / costs.bandwidths[op.resource]
                if isinstance(op, Reduce):
                    reduced[op.stage] = end
                elif isinstance(op, Exchange):
                    clock = end
                span = Span(position, str(op), op.resource, ready, end)
            elif isinstance(op, Drop):
                clock = max(clock, stored.get((op.what, op.stage), 0.0))
                continue
            elif isinstance(op, Fetch):
                clock = max(clock, loaded.get((BOUNDARY, op.index), 0.0))
                continue
            else:
                continue
            if measured:
                spans.extend(Span(s.position, s.name, s.resource, s.start - start,
                                  s.end - start) for s in (span, host) if s is not None)
    return Timeline(tuple(spans), clock - start)
