"""Decoder layers whose weights are read from the checkpoint for every forward pass.

A streamed layer owns no weight memory: its parameters point at a placeholder until a forward
pre-hook points them at views of a preallocated buffer ("slot") that an I/O thread filled
from the safetensors file; the forward post-hook points them back and hands the slot to the
I/O thread, which reads the next streamed layer into it. The I/O thread walks the streamed
layers in forward order, round and round (token after token), up to ``slots - 1`` layers
ahead of the compute, so reads overlap the compute of the layers before them. A forward pass
over many positions (the prefill over the prompt) runs each layer once, so it reads each
layer once.

Reads are ``pread`` into the slot (no memory map), in chunks (``models/safetensors_io.py``).
Before a layer is read, the page cache is emptied of the file outside that layer (what the
kernel read ahead past the previous one); while it is read, what was read of it is dropped after
each chunk. So the RAM that streaming holds is the slots, and the page cache holds at most a
chunk and the kernel's read-ahead behind the budget's back. A tensor stored in another dtype
than the compute dtype is read into the slot's raw area and converted into its typed area by the
I/O thread. While layers stream, torch computes with one thread fewer than it had, leaving a
core to the reads (on 2 cores, 2 compute threads and the reads' page copies descheduling one
another made decoding 3-4x slower than 1 compute thread).
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..core.units import format_bytes
from ..exec.io_threads import responsive_switching
from ..models.safetensors_io import StoredTensor, pread_exact

ALIGN = 64  # every tensor starts on a cache line in its slot, as torch's allocator places them
SAMPLE_BYTES = 256 << 20  # read before generating to measure the disk (about 0.1 s)


@dataclass(frozen=True)
class Entry:
    """One parameter of a streamed layer: its stored bytes and its place in a slot."""

    param: nn.Parameter
    stored: StoredTensor
    dtype: torch.dtype  # what the model computes with
    raw_offset: int  # bytes into the slot's raw area
    typed_offset: int | None  # bytes into the slot's typed area; None: used as stored

    @property
    def typed_bytes(self) -> int:
        return math.prod(self.stored.shape) * self.dtype.itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(params: list[tuple[nn.Parameter, StoredTensor]]) -> tuple[list[Entry], int, int]:
    """Place a layer's tensors in a slot, in file order: (entries, raw bytes, typed bytes).
    A tensor stored in its parameter's dtype is used in place; another gets a converted copy."""
    entries, raw, typed = [], 0, 0
    for param, stored in sorted(params, key=lambda ps: (str(ps[1].file), ps[1].offset)):
        convert = stored.dtype != param.dtype
        entry = Entry(param, stored, param.dtype, raw, typed if convert else None)
        entries.append(entry)
        raw = _aligned(raw + stored.nbytes)
        if convert:
            typed = _aligned(typed + entry.typed_bytes)
    return entries, raw, typed


def _byte_ranges(entries: list[Entry]) -> dict[Path, tuple[int, int]]:
    """{file: (first byte, end byte)} of a layer's tensors in each of its files."""
    ranges: dict[Path, tuple[int, int]] = {}
    for e in entries:
        first, end = ranges.get(e.stored.file, (e.stored.offset, e.stored.offset))
        ranges[e.stored.file] = (min(first, e.stored.offset),
                                 max(end, e.stored.offset + e.stored.nbytes))
    return ranges


def slot_bytes(layers: list[list[tuple[nn.Parameter, StoredTensor]]]) -> int:
    """The bytes of one slot that fits every one of ``layers``."""
    sizes = [layout(params)[1:] for params in layers]
    return max(raw for raw, _ in sizes) + max(typed for _, typed in sizes)


class LayerStreamer:
    """Streams the weights of ``layers`` (modules in forward order, each with its CPU
    parameters and their stored tensors) through ``slots`` reusable buffers; see the module
    docstring. ``reads``/``read_s`` count the layers read and the seconds it took,
    ``wait_s`` the seconds the compute waited for a read, ``disk_bandwidth`` what reads ran at
    before generation started (a prediction's input)."""

    def __init__(self, layers: list[tuple[nn.Module, list[tuple[nn.Parameter, StoredTensor]]]],
                 slots: int):
        if slots < 2:
            raise ValueError("streaming needs at least 2 slots: one computed, one read")
        self.modules = [module for module, _ in layers]
        laid = [layout(params) for _, params in layers]
        self.entries = [entries for entries, _, _ in laid]
        raw_size, typed_size = max(r for _, r, _ in laid), max(t for _, _, t in laid)
        # zeros, not empty: the pages are faulted in now, so that reads time the disk alone
        self.raw = [torch.zeros(raw_size, dtype=torch.uint8) for _ in range(slots)]
        self.typed = [torch.zeros(typed_size, dtype=torch.uint8) for _ in range(slots)]
        self.views = [[self._views(s, entries) for entries in self.entries]
                      for s in range(slots)]  # [slot][layer] -> one tensor per entry
        self.placeholders = {d: torch.empty(0, dtype=d)
                             for d in {e.dtype for entries in self.entries for e in entries}}
        for entries in self.entries:
            self._point(entries, None)
        self.ranges = [_byte_ranges(entries) for entries in self.entries]  # [layer][file]
        self.fds = {f: os.open(f, os.O_RDONLY) for f in
                    {e.stored.file for entries in self.entries for e in entries}}
        for fd in self.fds.values():  # what the page cache holds of the file is not ours
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.reads, self.bytes_read, self.read_s, self.wait_s = 0, 0, 0.0, 0.0
        self.disk_bandwidth = 0.0  # bytes/s of the reads ``start`` measured
        self.free: queue.Queue[int | None] = queue.Queue()
        self.ready: queue.Queue[tuple[int, int, BaseException | None]] = queue.Queue()
        self.stop = threading.Event()
        self.current: dict[int, int] = {}  # layer -> slot it is computing from
        self.hooks = [h for i, m in enumerate(self.modules) for h in (
            m.register_forward_pre_hook(self._pre(i)), m.register_forward_hook(self._post(i)))]
        self.thread: threading.Thread | None = None
        self.compute_threads = torch.get_num_threads()

    def _views(self, slot: int, entries: list[Entry]) -> list[torch.Tensor]:
        """The tensors the parameters of one layer become when it runs from ``slot``."""
        views = []
        for e in entries:
            area, offset = ((self.raw[slot], e.raw_offset) if e.typed_offset is None
                            else (self.typed[slot], e.typed_offset))
            view = area[offset:offset + e.typed_bytes].view(e.dtype).view(e.stored.shape)
            views.append(view)
        return views

    def _point(self, entries: list[Entry], views: list[torch.Tensor] | None) -> None:
        """Point the parameters at ``views``, or at empty placeholders with ``None``."""
        for i, e in enumerate(entries):
            e.param.data = views[i] if views is not None else self.placeholders[e.dtype]

    def read_layer(self, slot: int, layer: int) -> None:
        """Fill ``slot`` with the weights of streamed layer ``layer`` (blocking), counted in
        ``reads``, ``bytes_read`` and ``read_s``."""
        start = time.perf_counter()
        self._fill(slot, layer)
        self.read_s += time.perf_counter() - start
        self.reads += 1
        self.bytes_read += self._layer_bytes(layer)

    def _layer_bytes(self, layer: int) -> int:
        return sum(e.stored.nbytes for e in self.entries[layer])

    def _fill(self, slot: int, layer: int) -> None:
        """Read layer ``layer`` into ``slot``. First the page cache is emptied of the file
        outside this layer's bytes: what the kernel read ahead past the previous layer (done
        by now) goes, and the stray folios with it."""
        ranges = self.ranges[layer]
        for file, fd in self.fds.items():
            first, end = ranges.get(file, (0, 0))
            os.posix_fadvise(fd, 0, first, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, end, 0, os.POSIX_FADV_DONTNEED)  # 0: to the end of the file
        raw = self.raw[slot]
        for e, view in zip(self.entries[layer], self.views[slot][layer]):
            stored = raw[e.raw_offset:e.raw_offset + e.stored.nbytes]
            pread_exact(self.fds[e.stored.file], e.stored, stored, ranges[e.stored.file][0])
            if e.typed_offset is not None:
                view.copy_(stored.view(e.stored.dtype).view(e.stored.shape))

    def start(self) -> None:
        """Take a compute thread for the reads, read the first layer, measure the disk
        (``disk_bandwidth``), read the next layers, one per slot, and let the I/O thread run
        on."""
        self.compute_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, self.compute_threads - 1))
        # a file's first read ran at half the speed of the next ones here (1.25 against
        # 2.2-3.5 GB/s for tinyllama-1.1b's layers): the disk is measured after it
        self.read_layer(0, 0)
        self.disk_bandwidth = self._measure_disk(len(self.raw) - 1)
        self.ready.put((0, 0, None))
        preread = min(len(self.raw), len(self.modules))
        for slot in range(1, preread):
            self.read_layer(slot, slot)
            self.ready.put((slot, slot, None))
        for slot in range(preread, len(self.raw)):
            self.free.put(slot)
        responsive_switching()  # its reads wait for the interpreter lock between layers
        self.thread = threading.Thread(target=self._io, args=(preread - 1,),
                                       name="tierflow-layer-stream", daemon=True)
        self.thread.start()

    def _measure_disk(self, slot: int) -> float:
        """Bytes/s of reading the layers after the first into ``slot``, ``SAMPLE_BYTES`` of
        them or each once (a single read's rate varies by a quarter from layer to layer).
        Not counted as reads: the slot is filled again with the layer it is for."""
        done, start = 0, time.perf_counter()
        n = len(self.modules)
        for layer in [(1 + k) % n for k in range(n)]:
            self._fill(slot, layer)
            done += self._layer_bytes(layer)
            if done >= SAMPLE_BYTES:
                break
        return done / max(time.perf_counter() - start, 1e-9)

    def _io(self, layer: int) -> None:
        """Read the layers after ``layer``, round and round, each into the next free slot."""
        while True:
            layer = (layer + 1) % len(self.modules)
            slot = self.free.get()
            if slot is None or self.stop.is_set():
                return
            try:
                self.read_layer(slot, layer)
            except BaseException as e:  # handed to the compute thread, which raises it
                self.ready.put((slot, layer, e))
                return
            self.ready.put((slot, layer, None))

    def _pre(self, layer: int) -> Callable[..., None]:
        def acquire(module: nn.Module, args: tuple) -> None:
            start = time.perf_counter()
            slot, got, error = self.ready.get()
            self.wait_s += time.perf_counter() - start
            if error is not None:
                raise error
            if got != layer:
                raise RuntimeError(f"streamed layer {layer} ran but layer {got} was read next: "
                                   "the model must call its decoder layers once each, in order")
            self._point(self.entries[layer], self.views[slot][layer])
            self.current[layer] = slot
        return acquire

    def _post(self, layer: int) -> Callable[..., None]:
        def release(module: nn.Module, args: tuple, output: object) -> None:
            self._point(self.entries[layer], None)
            self.free.put(self.current.pop(layer))
        return release

    def summary(self) -> str:
        """What streaming did: layers and bytes read, read bandwidth, compute stalls."""
        return (f"read {self.reads} layers ({format_bytes(self.bytes_read)}) in "
                f"{self.read_s:.2f} s ({self.bandwidth / 1e9:.2f} GB/s); the compute waited "
                f"{self.wait_s:.2f} s for reads")

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the reads so far."""
        return self.bytes_read / max(self.read_s, 1e-9)

    def close(self) -> None:
        """Stop the I/O thread, give its core back to torch, remove the hooks, close the
        files."""
        self.stop.set()
        self.free.put(None)
        if self.thread is not None:
            self.thread.join()
        torch.set_num_threads(self.compute_threads)
        for hook in self.hooks:
            hook.remove()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
