"""Checkpoints on a lower tier: the stage boundaries x[i] a plan stashes (``Stash(i)``) wait
in a store until its ``Fetch(i)``, instead of in the compute tier.

``stash(i, x)`` takes x[i] over (the runner drops its reference); the plan's boundary ops
(``plan/boundary_schedule.py``) then go to ``dispatch``: a Store hands it to a writer thread
(its memory is freed once written), a Load starts reading it back; ``fetch(i)`` waits for
that read, or reads then. The planner counts one write and one read in flight
(``plan/boundary_stash.py``), so a Store first waits for the previous write. A checkpoint
stashed again before it is freed is in the store already: the plan stores it once.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..plan.boundary_stash import MIN_BOUNDARY_BYTES
from ..plan.ops import Load, Store, Transfer
from .disk import DiskStore
from .host_store import HostStore
from .io_threads import transfer_thread
from .trace import span

MIN_BYTES = MIN_BOUNDARY_BYTES  # the planner's threshold, read when a fit plans


@dataclass
class _Stashed:
    """Where x[i] waits: its file, its layout and the write that puts it there."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    written: Future | None = None  # None: held until the plan's Store
    read: Future | None = None


class BoundaryStash:
    """The stashed checkpoints of one fitted module, in ``store``."""

    def __init__(self, store: DiskStore | HostStore) -> None:
        self.store = store
        self._writer = transfer_thread("tierflow-stash-write")
        self._reader = transfer_thread("tierflow-stash-read")
        self._stashed: dict[int, _Stashed] = {}
        self._held: dict[int, torch.Tensor] = {}  # stashed, its Store not dispatched yet
        self._last_write: Future | None = None

    def stash(self, i: int, x: torch.Tensor) -> None:
        """Take x[i] over (the caller drops its own reference) until the plan stores it."""
        if i in self._stashed:  # fetched and stashed again: the store has these values
            self._stashed[i].read = None
            return
        self._held[i] = x.detach().contiguous()
        self._stashed[i] = _Stashed(f"boundary-{i}", x.shape, x.dtype, x.device)

    def dispatch(self, op: Transfer) -> None:
        """Run one of the plan's boundary ops: a Store writes x[i] down, a Load starts
        reading it back."""
        if isinstance(op, Store):
            if self._last_write is not None:
                self._last_write.result()
            stashed = self._stashed[op.stage]
            stashed.written = self._last_write = self._writer.submit(
                self._write, op, stashed.key, self._held.pop(op.stage))
        elif isinstance(op, Load):
            self._read_back(op.stage, op)
        else:
            raise ValueError(f"{op}: not a checkpoint transfer")

    def fetch(self, i: int) -> torch.Tensor:
        """x[i] back in memory; it stays in the store until ``forget``."""
        return self._read_back(i, None).result()

    def _read_back(self, i: int, load: Load | None) -> Future:
        """The read of x[i], started now unless on its way (``load``: the plan's op)."""
        stashed = self._stashed[i]
        if stashed.read is None:
            stashed.read = self._reader.submit(self._read, stashed, load)
        return stashed.read

    def forget(self, i: int) -> None:
        """x[i]'s values are no longer needed (freed, or the step is over)."""
        self._stashed.pop(i, None)
        self._held.pop(i, None)

    def reset(self) -> None:
        """Every write done (a failed one raises here) and nothing remembered, at the start
        and end of a step: a step writes its own checkpoints, even after one that stopped
        before its backward."""
        for stashed in self._stashed.values():
            if stashed.written is not None:
                stashed.written.result()
        self._stashed.clear()
        self._held.clear()
        self._last_write = None

    def _write(self, store: Store, key: str, x: torch.Tensor) -> None:
        with span(str(store), store.resource):
            self.store.write(key, [x])

    def _read(self, stashed: _Stashed, load: Load | None) -> torch.Tensor:
        """x[i] read back; ``load``: the plan's op (None: read at its Fetch)."""
        if stashed.written is None:
            raise RuntimeError(f"{stashed.key} is read back before the plan stored it")
        stashed.written.result()
        buffer = torch.empty(stashed.shape, dtype=stashed.dtype, device=stashed.device)
        with span(str(load) if load else f"read {stashed.key}",
                  load.resource if load else "compute"):
            self.store.read(stashed.key, [buffer])
        return buffer
