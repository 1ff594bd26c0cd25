"""Page-locked host memory for the copies that live in host RAM below a GPU, without the
waste of PyTorch's pinned allocator.

PyTorch's caching host allocator rounds every page-locked request up to a power of two, so a
Llama-3-8B MLP weight of 112 MiB takes 128 MiB and the host copies of its weights, AdamW
moments and gradients take about 10% more than their bytes: measured on an H200, a plan of
59.9 GiB of host RAM peaked at 67.4 GiB. ``PinnedHeap`` asks that allocator only for segments
whose sizes are already powers of two (nothing is rounded) and carves tensors out of them,
first fit, 512-byte aligned; a freed range is merged with its free neighbours and reused.
A new segment is as large as what the heap holds already (it doubles), at least the tensor
that asked for it and at most 1 GiB unless that tensor needs more: a small model's copies
lock little more than their bytes, a large one's at most the free end of its last segment.
Segments are kept until the heap goes (their pages stay locked, as the caching allocator would
keep them too). Safe to use from several I/O threads at once.
"""
from __future__ import annotations

import math
import threading

import torch

from ..core.config import PINNED_SEGMENT_BYTES

ALIGN = 512  # bytes: a carved tensor's offset in its segment, a multiple of every dtype's size
SEGMENT = PINNED_SEGMENT_BYTES  # the largest segment, unless a tensor needs a larger one


class PinnedHeap:
    """Tensors carved from page-locked segments (pageable ones with ``pin=False``, which
    only the tests use: the carving is the same)."""

    def __init__(self, pin: bool = True, segment_bytes: int = SEGMENT) -> None:
        if segment_bytes & (segment_bytes - 1):
            raise ValueError(f"segment_bytes {segment_bytes} is not a power of two")
        self.pin = pin
        self.segment_bytes = segment_bytes
        self._segments: list[torch.Tensor] = []  # uint8, each a power of two of bytes
        self._free: list[list[tuple[int, int]]] = []  # per segment: (offset, bytes), sorted
        self._used: dict[int, tuple[int, int, int]] = {}  # data_ptr -> (segment, offset, bytes)
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        """The bytes of every segment: what the heap holds in RAM."""
        return sum(s.numel() for s in self._segments)

    @property
    def used_bytes(self) -> int:
        """The bytes of the tensors carved out and not freed (alignment included)."""
        return sum(n for _, _, n in self._used.values())

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``dtype`` in the heap."""
        size = math.prod(shape) * dtype.itemsize
        nbytes = max(ALIGN, _aligned(size))
        with self._lock:
            place = self._find(nbytes)
            if place is None:
                place = (self._grow(nbytes), 0)
            segment, offset = place
            self._take(segment, offset, nbytes)
            tensor = self._segments[segment][offset:offset + size].view(dtype).view(shape)
            self._used[tensor.data_ptr()] = (segment, offset, nbytes)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Give ``tensor``'s range back (it must not be used afterwards)."""
        with self._lock:
            segment, offset, nbytes = self._used.pop(tensor.data_ptr())
            ranges = sorted([*self._free[segment], (offset, nbytes)])
            merged = [ranges[0]]
            for start, size in ranges[1:]:
                last_start, last_size = merged[-1]
                if last_start + last_size == start:
                    merged[-1] = (last_start, last_size + size)
                else:
                    merged.append((start, size))
            self._free[segment] = merged

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was carved from this heap and not freed."""
        with self._lock:
            return tensor.data_ptr() in self._used

    def _find(self, nbytes: int) -> tuple[int, int] | None:
        for segment, ranges in enumerate(self._free):
            for offset, size in ranges:
                if size >= nbytes:
                    return segment, offset
        return None

    def _take(self, segment: int, offset: int, nbytes: int) -> None:
        ranges = self._free[segment]
        at = next(k for k, (start, _) in enumerate(ranges) if start == offset)
        start, size = ranges.pop(at)
        if size > nbytes:
            ranges.insert(at, (start + nbytes, size - nbytes))

    def _grow(self, nbytes: int) -> int:
        size = max(min(self.segment_bytes, self.reserved_bytes), 1 << (nbytes - 1).bit_length())
        self._segments.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self._free.append([(0, size)])
        return len(self._segments) - 1


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
