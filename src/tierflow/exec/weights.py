"""Stage weights on the disk tier, fetched into the compute tier ahead of use.

A streamed parameter keeps its ``nn.Parameter`` object, shape and optimizer-state identity;
only its storage comes and goes (``untyped_storage().resize_``), so the model code and the
optimizer never notice. One I/O thread reads the next ``depth`` streamed stages of the plan
while the current one computes (their reads start as the current operation starts, so that
they overlap it); another writes updated weights back after each update and frees them once
they are on disk. A stage is read again only after its write-back is done. The stage updated
last in a step is the first streamed one of the next step's forward: its weights, and those
of the ``depth`` stages updated before it, are written back but stay resident
(``kept_across_steps``), since their reads would have no compute beside them. The weights
of a stage the optimizer steps in host RAM (``host_updated``) are not written back: the
update changed their copy there, so the one on the compute tier is dropped. Nor are frozen
weights (no gradient, no update): they are only dropped.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from torch import nn

from ..plan.ops import Backward, Forward, Op, Update
from .disk import WriteBehind
from .offload import OffloadedParameters
from .trace import span


class WeightStreamer:
    """The weights of the streamed stages of a chain, living in ``offloaded`` between uses."""

    def __init__(self, stage_params: dict[int, list[nn.Parameter]],
                 offloaded: OffloadedParameters, depth: int, names: dict[int, str],
                 updates_in_backward: bool = True, host_updated: frozenset[int] = frozenset()):
        self.stage_params = stage_params
        self.updates_in_backward = updates_in_backward  # else the weights change after backward
        self.host_updated = host_updated
        self.offloaded = offloaded
        self.depth = depth
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierflow-read")
        self._writer = WriteBehind("tierflow-write")  # one stage's weights queued
        self._reads: dict[int, Future] = {}
        self._resident: set[int] = set()
        for params in stage_params.values():  # the weights move to disk now (if not there)
            for p in params:
                if p not in offloaded:
                    offloaded.offload(names[id(p)], p)

    @property
    def streamed(self) -> set[int]:
        return set(self.stage_params)

    # ------------------------------------------------------------------ around plan ops

    def before(self, ops: Sequence[Op], position: int) -> None:
        """Make the weights ``ops[position]`` needs resident (waiting for, or starting, their
        read), then start reading the next ``depth`` streamed stages after its own, which
        arrive while it runs."""
        i = _stage_of(ops[position])
        if i in self.stage_params:
            self.hold(i)
            if isinstance(ops[position], Update):  # a kept stage's last write reads them
                self._wait_write(i)
        self.prefetch(ops[position + 1:], running=i)

    def after(self, ops: Sequence[Op], position: int, taped: set[int]) -> None:
        """After ``ops[position]``: write back updated weights and drop weights nothing needs
        before their next fetch."""
        op = ops[position]
        i = _stage_of(op)
        if i in self.stage_params:
            if isinstance(op, Update) and i in self.host_updated:
                self._release(i)  # stale: the update ran on the copy in host RAM
            elif isinstance(op, Update) and self.updates_in_backward:
                self.write_back(i, keep=kept_across_steps(ops, position, self.stage_params,
                                                          self.depth))
            elif i not in taped and _next_use(ops, position, i) != _next_streamed(
                    ops, position, self.stage_params):
                self._release(i)

    def prefetch(self, ops: Sequence[Op], running: int | None = None) -> None:
        """Start reading the first ``depth`` streamed stages that ``ops`` use besides the
        ``running`` one, which is resident already (at the end of a step, ``ops`` are the
        next step's: the same plan runs again)."""
        upcoming: list[int] = []
        if self.depth == 0:  # read on demand, in ``before``
            return
        if running is None:  # between steps: a stage kept resident is the first to run
            first = next((j for op in ops if (j := _stage_of(op)) in self.stage_params), None)
            running = first if first in self._resident else None
        for op in ops:
            j = _stage_of(op)
            if j in self.stage_params and j != running and j not in upcoming:
                upcoming.append(j)
                if len(upcoming) == self.depth:
                    break
        for j in upcoming:
            self.fetch(j)

    def hold(self, i: int) -> None:
        """Stage i's weights resident now (waiting for their read; for work outside the
        plan's ops too, such as an update pass or splitting the inputs)."""
        self.fetch(i)
        self._reads.pop(i).result()

    def wait_writes(self) -> None:
        self._writer.wait()

    def settle(self) -> None:
        """Until no read or write is in flight: every weight is then either resident with its
        current values or on disk, up to date, with an empty storage."""
        for future in list(self._reads.values()):
            future.result()
        self.wait_writes()

    def drop_fetched(self) -> None:
        """After a step that failed before any update: every weight back on its tier only,
        none resident or on its way, as before the step's first read. (The copies there are
        current: no stage was updated, so nothing resident is newer.)"""
        self.settle()
        self._reads.clear()
        for i in list(self._resident):
            self._release(i)

    def close(self) -> None:
        self.wait_writes()
        self._reader.shutdown()
        self._writer.shutdown()

    # ------------------------------------------------------------------ transfers

    def fetch(self, i: int) -> None:
        """Start reading stage i's weights unless they are resident or on their way."""
        if i in self._reads or i in self._resident:
            if i not in self._reads:
                self._reads[i] = _done()
            return
        pending = self._writer.writes.get(i)
        self._reads[i] = self._reader.submit(self._read, i, pending)
        self._resident.add(i)

    def _read(self, i: int, pending: Future | None) -> None:
        if pending is not None:
            pending.result()
        with span(f"read weights {i}", "disk read"):
            for p in self.stage_params[i]:
                self.offloaded.read(p)

    def write_back(self, i: int, keep: bool = False) -> None:
        """Write stage i's (updated) weights to disk on the writer thread, then drop them
        unless ``keep``: they stay resident for their next use (read, not changed, while the
        write runs; dropping them later waits for it)."""
        params = self.stage_params[i]
        self._writer.submit(i, self._write, i, params, not keep)
        if not keep:
            self._resident.discard(i)

    def _write(self, i: int, params: list[nn.Parameter], empty: bool) -> None:
        with span(f"write weights {i}", "disk write"):
            for p in params:
                if p.requires_grad:  # a frozen weight's copy on its tier is current
                    self.offloaded.write(p)
                if empty:
                    self.offloaded.empty(p)

    def _wait_write(self, i: int) -> None:
        """Until stage i's last write is done: a kept stage's may still read its storage."""
        pending = self._writer.writes.get(i)
        if pending is not None:
            pending.result()

    def _release(self, i: int) -> None:
        self._wait_write(i)
        for p in self.stage_params[i]:
            self.offloaded.empty(p)
        self._resident.discard(i)


def kept_across_steps(ops: Sequence[Op], position: int, streamed: dict, depth: int) -> bool:
    """Whether the stage of ``ops[position]`` (an update) is among the next ``depth`` + 1
    streamed stages the plan uses, counting on into the next step (the same plan runs
    again): it then keeps its weights resident rather than reading them back, in one of the
    buffers reading ahead uses. These are the last stages updated in a step, the first
    streamed ones of the next forward, whose reads would have no compute to hide behind."""
    i = _stage_of(ops[position])
    upcoming: list[int] = []
    for op in (*ops[position + 1:], *ops[:position + 1]):
        j = _stage_of(op)
        if j in streamed and j not in upcoming:
            if j == i:
                return True
            upcoming.append(j)
            if len(upcoming) > depth:
                return False
    return False


def _stage_of(op: Op) -> int | None:
    return op.stage if isinstance(op, (Forward, Backward, Update)) else None


def _next_use(ops: Sequence[Op], position: int, i: int) -> int | None:
    for k in range(position + 1, len(ops)):
        if _stage_of(ops[k]) == i:
            return k
    return None


def _next_streamed(ops: Sequence[Op], position: int, streamed: dict) -> int | None:
    for k in range(position + 1, len(ops)):
        if _stage_of(ops[k]) in streamed:
            return k
    return None


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def stage_parameters_to_stream(stages: Sequence[nn.Module]) -> dict[int, list[nn.Parameter]]:
    """Per stage, the parameters only that stage uses (shared ones, like tied embeddings,
    stay resident): what streaming may move. Stages with none are left out."""
    users: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, stage in enumerate(stages):
        for p in stage.parameters():
            key = id(p)
            users.setdefault(key, set()).add(i)
            params[key] = p
    out: dict[int, list[nn.Parameter]] = {}
    for key, where in users.items():
        p = params[key]
        if len(where) == 1 and p.is_contiguous():
            out.setdefault(next(iter(where)), []).append(p)
    return {i: ps for i, ps in sorted(out.items())}
