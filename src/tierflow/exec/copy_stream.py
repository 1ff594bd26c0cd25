"""Copies between host memory and an accelerator on side streams, so that they overlap the
kernels of the compute stream instead of queueing behind them.

Each I/O thread gets a stream of its own (a weights read, a states read and a tape write can
then run at once, on the copy engines, beside the compute). What a copy waits for on the
compute stream (``after``):
- by default, every kernel queued there so far: the buffers it writes into were allocated
  on the compute stream, and a block the caching allocator hands out again may still be
  read by a kernel queued there;
- a store of what the compute made waits for an event marked when the plan dispatched it
  (``mark``, on the compute thread): the kernels that made its sources, and none queued
  since (the next stage's backward, which would hold the copy back by a stage);
- a read into memory that ``refill`` gave from the side stream waits for nothing: that
  memory was never the compute stream's, and ``refill`` records the compute stream's use of
  it, so that the allocator hands it out again only after the compute stream's kernels
  queued when it is freed.
The thread then waits for its copy, so when a store's ``read`` or ``write`` returns, the
bytes have arrived and the source may be freed or changed; only the I/O thread waits, never
the compute stream. Device-agnostic through ``torch.get_device_module``; on the CPU a copy
is a plain ``copy_``.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

# ``after`` for a copy into memory that ``refill`` gave: it waits for nothing
FRESH = False
# what a copy waits for on the compute stream: None (everything queued so far), an event
# from ``mark``, or FRESH (nothing)
CopyAfter = "torch.Event | bool | None"


class SideStreamCopier:
    """Copies for one compute device (its current stream, captured when this is built, is
    the compute stream the copies are ordered after)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._module = None if self.device.type == "cpu" else \
            torch.get_device_module(self.device)
        self._compute = self._module.current_stream(self.device) if self._module else None
        self._local = threading.local()  # each thread's side stream

    def mark(self) -> torch.Event | None:
        """An event on the compute stream now (None on the CPU): call it where a store is
        dispatched, and pass it as the store's ``after``."""
        if self._module is None:
            return None
        event = self._module.Event()
        event.record(self._compute)
        return event

    def refill(self, t: torch.Tensor, nbytes: int) -> None:
        """Give ``t``'s empty storage ``nbytes`` again, from this thread's side stream on an
        accelerator (a copy into it then waits for nothing: pass ``after=FRESH``), its use by
        the compute stream recorded."""
        if self._module is None or t.device.type != self.device.type:
            t.untyped_storage().resize_(nbytes)
            return
        with self._module.stream(self._stream()):
            t.untyped_storage().resize_(nbytes)
        t.record_stream(self._compute)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of fresh memory on ``device``: on this copier's accelerator from this
        thread's side stream as ``refill`` gives it (a copy into it waits for nothing:
        ``after=FRESH``); elsewhere plain memory (a copier of a store that started on the
        CPU copies in line, on the current stream)."""
        out = torch.empty(0, dtype=torch.uint8, device=device)
        self.refill(out, nbytes)
        return out.resize_(nbytes)  # the shape only: the storage holds the bytes already

    def copy(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             after: CopyAfter = None) -> None:
        """``targets[k].copy_(sources[k])`` for each k, finished when this returns (a pair
        that is one tensor twice, a CPU tensor the disk tier needs no staging for, is
        skipped). ``after``: what it waits for on the compute stream (the module docstring):
        None, everything queued so far; an event from ``mark``; ``FRESH``, nothing."""
        pairs = [(target, source) for target, source in zip(targets, sources)
                 if target is not source]
        if self._module is None or not any(_on_accelerator(t) for pair in pairs for t in pair):
            for target, source in pairs:
                target.copy_(source)
            return
        stream = self._stream()
        if after is None:
            stream.wait_stream(self._compute)
        elif after is not FRESH:
            stream.wait_event(after)
        with self._module.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
        stream.synchronize()

    def pinned(self) -> bool:
        """Whether host copies should be page-locked (an accelerator copies them directly)."""
        return self._module is not None

    def _stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._module.Stream(self.device)
        return stream


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"
