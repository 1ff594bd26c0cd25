"""Stage weights on a lower tier, moved into the compute tier by the plan's transfer ops.

A streamed parameter keeps its ``nn.Parameter`` object, shape and optimizer-state identity;
only its storage comes and goes (``untyped_storage().resize_``), so the model code and the
optimizer never notice. The streamer runs the plan's ``Load``, ``Store`` and ``Drop`` ops of
weights where the plan puts them (``plan/weight_schedule.py`` places them) and derives no
schedule of its own: a Load starts a read on the reader thread (after the stage's last
write, if one is in flight), a Store a write on the writer thread (its copy in memory
dropped once written, unless kept), a Drop empties the stage's storages (after its write).
An op of a streamed stage waits for the stage's last read (``wait_loaded``).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

from torch import nn

from ..plan.ops import Drop, Load, Store, Transfer
from .copy_stream import CopyAfter
from .disk import WriteBehind
from .io_threads import transfer_thread
from .offload import OffloadedParameters
from .trace import span


class WeightStreamer:
    """The weights of the streamed stages of a chain, living in ``offloaded`` between uses."""

    def __init__(self, stage_params: dict[int, list[nn.Parameter]],
                 offloaded: OffloadedParameters, names: dict[int, str]):
        self.stage_params = stage_params
        self.offloaded = offloaded
        self._reader = transfer_thread("tierflow-read")
        self._writer = WriteBehind("tierflow-write")  # one stage's weights queued
        self._reads: dict[int, Future] = {}  # stage -> its last read
        self._resident: set[int] = set()  # stages in memory or on their way
        for params in stage_params.values():  # the weights move to their tier now (if not there)
            for p in params:
                if p not in offloaded:
                    offloaded.offload(names[id(p)], p)

    @property
    def streamed(self) -> set[int]:
        return set(self.stage_params)

    @property
    def resident(self) -> frozenset[int]:
        """The streamed stages whose weights are in memory or being read."""
        return frozenset(self._resident)

    # ------------------------------------------------------------------ the plan's ops

    def dispatch(self, op: Transfer) -> None:
        """Start the plan's transfer ``op`` (a Load, Store or Drop of a stage's weights)."""
        if isinstance(op, Load):
            self._load(op.stage, str(op), op.resource)
        elif isinstance(op, Store):
            self._store(op.stage, op.keep, str(op), op.resource)
        elif isinstance(op, Drop):
            self._release(op.stage)

    def wait_loaded(self, i: int) -> None:
        """Until stage i's last read is done (its weights are in memory)."""
        read = self._reads.get(i)
        if read is not None:
            read.result()

    def wait_stored(self, i: int) -> None:
        """Until stage i's last write is done (a kept stage's may still read its storage)."""
        pending = self._writer.writes.get(i)
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------ around steps

    def wait_writes(self) -> None:
        self._writer.wait()

    def settle(self) -> None:
        """Until no read or write is in flight: every weight is then either resident with its
        current values or on its tier, up to date, with an empty storage."""
        for future in list(self._reads.values()):
            future.result()
        self.wait_writes()

    def drop_fetched(self) -> None:
        """After a step that failed before any update, or before another plan runs: every
        weight back on its tier only, none resident or on its way (the copies there are
        current: nothing resident is newer)."""
        self.settle()
        self._reads.clear()
        for i in list(self._resident):
            self._release(i)

    def close(self) -> None:
        self.wait_writes()
        self._reader.shutdown()
        self._writer.shutdown()

    # ------------------------------------------------------------------ transfers

    def _load(self, i: int, name: str, resource: str) -> None:
        pending = self._writer.writes.get(i)
        self._reads[i] = self._reader.submit(self._read, i, pending, name, resource)
        self._resident.add(i)

    def _read(self, i: int, pending: Future | None, name: str, resource: str) -> None:
        if pending is not None:
            pending.result()
        with span(name, resource):
            self.offloaded.read_all(self.stage_params[i])

    def _store(self, i: int, keep: bool, name: str, resource: str) -> None:
        """Write stage i's (updated) weights to their tier on the writer thread, then drop
        them unless ``keep``: they stay resident for their next use (read, not changed,
        while the write runs; dropping them later waits for it)."""
        params = self.stage_params[i]
        self._writer.submit(i, self._write, params, not keep, name, resource,
                            self.offloaded.store.copier.mark())
        if not keep:
            self._resident.discard(i)

    def _write(self, params: list[nn.Parameter], empty: bool, name: str, resource: str,
               after: CopyAfter) -> None:
        with span(name, resource):
            # a frozen weight's copy on its tier is current
            self.offloaded.write_all([p for p in params if p.requires_grad], after)
            if empty:
                for p in params:
                    self.offloaded.empty(p)

    def _release(self, i: int) -> None:
        self.wait_stored(i)
        for p in self.stage_params[i]:
            self.offloaded.empty(p)
        self._resident.discard(i)


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
