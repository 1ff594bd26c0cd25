"""Copies between host memory and an accelerator on side streams, so that they overlap the
kernels of the compute stream instead of queueing behind them.

Each I/O thread gets a stream of its own (a weights read, a states read and a tape write can
then run at once, on the copy engines, beside the compute). A copy first waits for what the
compute stream has queued so far: the buffers it writes into were allocated on the compute
stream, and a block the caching allocator hands out again may still be read by a kernel
queued there. The thread then waits for its copy, so when a store's ``read`` or ``write``
returns, the bytes have arrived and the source may be freed or changed; only the I/O thread
waits, never the compute stream. Device-agnostic through ``torch.get_device_module``; on the
CPU a copy is a plain ``copy_``.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class SideStreamCopier:
    """Copies for one compute device (its current stream, captured when this is built, is
    the compute stream the copies are ordered after)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._module = None if self.device.type == "cpu" else \
            torch.get_device_module(self.device)
        self._compute = self._module.current_stream(self.device) if self._module else None
        self._local = threading.local()  # each thread's side stream

    def copy(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """``targets[k].copy_(sources[k])`` for each k, finished when this returns (a pair
        that is one tensor twice, a CPU tensor the disk tier needs no staging for, is
        skipped)."""
        pairs = [(target, source) for target, source in zip(targets, sources)
                 if target is not source]
        if self._module is None or not any(_on_accelerator(t) for pair in pairs for t in pair):
            for target, source in pairs:
                target.copy_(source)
            return
        stream = self._stream()
        stream.wait_stream(self._compute)
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
