"""Checkpoints on a lower tier: the stage boundaries x[i] a plan stashes (``Stash(i)``) wait
in a store until its ``Fetch(i)``, instead of in the compute tier.

``stash(i, x)`` hands x[i] to a writer thread (its memory is freed once written, the
runner having dropped its reference) and remembers where it went; ``prefetch(i)`` starts
reading it back (the runner calls it as the backward before the ``Fetch`` starts);
``fetch(i)`` waits for that read, or reads then. The planner counts one write and one read
in flight (``plan/boundary_stash.py``), so a stash first waits for the previous write. A
checkpoint stashed again before its values change is not written twice.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..plan.boundary_stash import MIN_BOUNDARY_BYTES
from .disk import DiskStore
from .host_store import HostStore
from .trace import span

MIN_BYTES = MIN_BOUNDARY_BYTES  # the planner's threshold, read when a fit plans


@dataclass
class _Stashed:
    """Where x[i] waits: its file, its layout and the write that puts it there."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    written: Future
    read: Future | None = None


class BoundaryStash:
    """The stashed checkpoints of one fitted module, in ``store``."""

    def __init__(self, store: DiskStore | HostStore) -> None:
        self.store = store
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierflow-stash-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierflow-stash-read")
        self._stashed: dict[int, _Stashed] = {}
        self._last_write: Future | None = None

    def stash(self, i: int, x: torch.Tensor) -> None:
        """Send x[i] to the store (the caller drops its own reference)."""
        if i in self._stashed:  # fetched and stashed again: the store has these values
            self._stashed[i].read = None
            return
        if self._last_write is not None:
            self._last_write.result()
        key = f"boundary-{i}"
        self._last_write = self._writer.submit(self._write, i, key, x.detach().contiguous())
        self._stashed[i] = _Stashed(key, x.shape, x.dtype, x.device, self._last_write)

    def prefetch(self, i: int) -> None:
        """Start reading x[i] back (a no-op if it is on its way or not stashed)."""
        stashed = self._stashed.get(i)
        if stashed is not None and stashed.read is None:
            stashed.read = self._reader.submit(self._read, i, stashed)

    def fetch(self, i: int) -> torch.Tensor:
        """x[i] back in memory; it stays in the store until ``forget``."""
        self.prefetch(i)
        return self._stashed[i].read.result()

    def forget(self, i: int) -> None:
        """x[i]'s values are no longer needed (freed, or the step is over)."""
        self._stashed.pop(i, None)

    def reset(self) -> None:
        """Every write done (a failed one raises here) and nothing remembered, at the start
        and end of a step: a step writes its own checkpoints, even after one that stopped
        before its backward."""
        for stashed in self._stashed.values():
            stashed.written.result()
        self._stashed.clear()
        self._last_write = None

    def _write(self, i: int, key: str, x: torch.Tensor) -> None:
        with span(f"stash x{i}", "disk write"):
            self.store.write(key, [x])

    def _read(self, i: int, stashed: _Stashed) -> torch.Tensor:
        stashed.written.result()
        buffer = torch.empty(stashed.shape, dtype=stashed.dtype, device=stashed.device)
        with span(f"fetch x{i}", "disk read"):
            self.store.read(stashed.key, [buffer])
        return buffer
