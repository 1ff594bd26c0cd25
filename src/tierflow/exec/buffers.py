"""Reusable byte buffers for what the disk tier reads back again and again (a stage's
optimizer states, every step).

A fresh buffer per read is fresh memory: under an exact RAM budget (``exec/memory.py``)
every large allocation is its own mapping, so each read first faults its pages in, on the
I/O thread, beside the compute. The decoder layers of a model have states of one size, so a
buffer freed by one stage's write fits the next stage's read: the pool keeps ``keep`` free
buffers for that, which the plan already counts as the read-ahead it holds, during the
updates. Other stages' states (an embedding's, a head's) differ in size, so the pool
allocates each buffer for the largest group it was told to ``expect``: any buffer then
serves any read, and the plan's one buffer of the largest stage's states holds. Between
the updates (a step's forward and backward) the plan counts no such buffer, so the optimizer
``release``s the pool after a step's last update: a free buffer kept from one update pass to
the next stayed resident through every later step's forward and backward (llama-20m fp32
--ram 380MiB --disk: stage 0's 62.5 MiB of states from step 3 on, beside the LM head's
forward, 390-407 MiB above the baseline against 366-377 predicted). Under a
GPU the buffers are on the GPU: the states come back from host RAM to where their update
runs.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from .file_io import round_up


class BufferPool:
    """Flat byte buffers, taken for a group of tensors and given back when none of them is
    used any more."""

    def __init__(self, keep: int = 1, device: torch.device | str = "cpu",
                 allocate: Callable[[int], torch.Tensor] | None = None):
        self.keep = keep
        self.device = torch.device(device)  # where the tensors are used: states read back
        # fresh bytes (below a GPU, a side stream's: ``SideStreamCopier.empty``)
        self._allocate = allocate or (lambda nbytes: torch.empty(
            nbytes, dtype=torch.uint8, device=self.device))
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._released = False  # from ``release`` to ``reuse``: give keeps none
        self._expected = 0  # bytes of the largest group expected: what a buffer is made for

    def views(self, shapes: Sequence[tuple[torch.Size, torch.dtype]]
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(flat buffer, one tensor per (shape, dtype) viewing it): each starts at an
        ``ALIGN`` boundary of the buffer, so that a page-aligned buffer reads directly."""
        sizes, offsets, total = _layout(shapes)
        flat = self._take(total)
        views = [flat[start:start + size].view(dtype).view(shape)
                 for (shape, dtype), start, size in zip(shapes, offsets, sizes)]
        return flat, views

    def expect(self, shapes: Sequence[tuple[torch.Size, torch.dtype]]) -> None:
        """A group of tensors of these (shape, dtype)s will be taken: make every buffer
        from now on large enough for it."""
        with self._lock:
            self._expected = max(self._expected, _layout(shapes)[2])

    def give(self, flat: torch.Tensor) -> None:
        """``flat`` is free again: keep it for a later read (the largest ``keep`` free ones)."""
        with self._lock:
            if self._released:
                return
            self._free.append(flat)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self.keep:]

    def release(self) -> None:
        """Drop the free buffers, and those given back until ``reuse`` (the writes still in
        flight after a step's last update, which end during the next forward)."""
        with self._lock:
            self._free.clear()
            self._released = True

    def reuse(self) -> None:
        """Keep free buffers again (a step's updates begin)."""
        with self._lock:
            self._released = False

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._free)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._free.remove(best)
                return best
        return self._allocate(max(nbytes, self._expected, 1))


def _layout(shapes: Sequence[tuple[torch.Size, torch.dtype]]) -> tuple[list[int], list[int], int]:
    """(bytes of each tensor, its offset, the bytes of them all) of a group laid out back
    to back, each starting at an ``ALIGN`` boundary."""
    sizes = [shape.numel() * dtype.itemsize for shape, dtype in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += round_up(size)
    return sizes, offsets, total
