"""The RAM tier below a (simulated) GPU: tensors kept as host copies, read back by copying.

It has the disk store's interface (``write``, ``read``, ``bytes``), so whatever streams
from disk streams from host memory the same way: on a GPU machine this is where weights and
optimizer states wait between uses; on this CPU-only machine it is the middle tier of the
simulated three-tier plan (``FitConfig(simulated_gpu=True)``), with real copies, accounted
apart from the compute tier.
"""
from __future__ import annotations

import time

import torch


class HostStore:
    """Copies of tensors in host memory, one entry per key, reused when rewritten."""

    kind = "ram"

    def __init__(self) -> None:
        self._entries: dict[str, list[torch.Tensor]] = {}
        self.peak_bytes = 0

    @property
    def bytes(self) -> int:
        """What the tier holds now."""
        return sum(t.nbytes for tensors in self._entries.values() for t in tensors)

    def write(self, key: str, tensors: list[torch.Tensor]) -> None:
        """Keep a copy of ``tensors`` under ``key`` (into the previous copy when it fits)."""
        kept = self._entries.get(key)
        if kept is None or [t.shape for t in kept] != [t.shape for t in tensors] or \
                [t.dtype for t in kept] != [t.dtype for t in tensors]:
            kept = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]
            self._entries[key] = kept
        for copy, t in zip(kept, tensors):
            copy.copy_(t)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def read(self, key: str, tensors: list[torch.Tensor]) -> None:
        """Fill ``tensors`` from the copy under ``key``."""
        for t, copy in zip(tensors, self._entries[key]):
            t.copy_(copy)


def measure_copy_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes per second of a host-to-host copy (the link of the simulated GPU)."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # touch the pages first
    start = time.perf_counter()
    target.copy_(source)
    return nbytes / max(time.perf_counter() - start, 1e-9)
