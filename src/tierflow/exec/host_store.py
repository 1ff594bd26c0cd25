"""The RAM tier below a GPU (real or simulated): tensors kept as host copies, read back by
copying.

It has the disk store's interface (``write``, ``read``, ``bytes``), so whatever streams
from disk streams from host memory the same way: on a GPU machine this is where weights,
optimizer states and tapes wait between uses, in page-locked memory, copied on side streams
that overlap the compute (``exec/copy_stream.py``); on a CPU-only machine it is the middle
tier of the simulated three-tier plan (``FitConfig(simulated_gpu=True)``), with real copies,
accounted apart from the compute tier.
"""
from __future__ import annotations


import torch

from .copy_stream import CopyAfter, SideStreamCopier
from .pinned import PinnedHeap


class HostStore:
    """Copies of tensors in host memory, one entry per key, reused when rewritten.
    ``device``: the compute tier's (on an accelerator the copies are page-locked, carved from
    a ``PinnedHeap``, and move on side streams)."""

    kind = "ram"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._entries: dict[str, list[torch.Tensor]] = {}
        self.copier = SideStreamCopier(device)
        self._heap = PinnedHeap() if self.copier.pinned() else None
        self.peak_bytes = 0

    @property
    def unused_bytes_bound(self) -> int:
        """The most RAM the store may hold beyond its copies: the unused end of its
        page-locked heap's last segment (0 when the copies are pageable)."""
        return self._heap.segment_bytes if self._heap is not None else 0

    @property
    def bytes(self) -> int:
        """What the tier holds now."""
        return sum(t.nbytes for tensors in self._entries.values() for t in tensors)

    def write(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Keep a copy of ``tensors`` under ``key`` (into the previous copy when it fits)."""
        self.write_all([(key, tensors)], after)

    def write_all(self, items: list[tuple[str, list[torch.Tensor]]],
                  after: CopyAfter = None) -> None:
        """``write`` each (key, tensors) of ``items``, in one transfer (below a GPU: one
        wait for the compute stream and one for the copies, not one per tensor)."""
        targets, sources = [], []
        for key, tensors in items:
            kept = self._entries.get(key)
            if kept is None or [t.shape for t in kept] != [t.shape for t in tensors] or \
                    [t.dtype for t in kept] != [t.dtype for t in tensors]:
                self.discard(key)
                kept = [self._empty(t) for t in tensors]
                self._entries[key] = kept
            targets += kept
            sources += tensors
        self.copier.copy(targets, sources, after)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def read(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Fill ``tensors`` from the copy under ``key``."""
        self.read_all([(key, tensors)], after)

    def read_all(self, items: list[tuple[str, list[torch.Tensor]]],
                 after: CopyAfter = None) -> None:
        """``read`` each (key, tensors) of ``items``, in one transfer."""
        self.copier.copy([t for _, tensors in items for t in tensors],
                         [t for key, _ in items for t in self._entries[key]], after)

    def entries(self, key: str) -> list[torch.Tensor]:
        """The copies under ``key`` themselves, for work on them in place: the host optimizer
        steps a streamed stage's weights right here, from gradients stashed here."""
        return self._entries[key]

    def discard(self, key: str) -> None:
        """Forget the copy under ``key`` (its memory is free once nothing else holds it; in
        the heap, at once: nothing may hold it)."""
        for t in self._entries.pop(key, []):
            if self._heap is not None:
                self._heap.free(t)

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        if self._heap is not None:
            return self._heap.empty(like.shape, like.dtype)
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")
