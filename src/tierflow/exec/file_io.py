"""How a list of CPU tensors goes to a file and comes back: past the page cache with
``O_DIRECT`` where the file system allows it, through it otherwise.

Direct I/O moves the bytes by DMA between the tensor's memory and the device: the CPU copies
nothing and no page-cache pages are made and dropped. On two cores that is most of the cost
of a disk tier: a thread writing and reading through the page cache beside a Llama layer's
forward and backward slowed them 1.33x, one doing the same past it not measurably (0.94x;
``benchmarks/io_interference.py``).

Direct I/O wants the memory address, the file offset and the length aligned to the device's
block size (``ALIGN`` covers 512-byte and 4 KiB devices). Each tensor starts at an aligned
offset of its file (the gap after it is padding). A tensor whose memory is aligned moves
directly, except its last partial block; that block, and every tensor whose memory is not
aligned, goes through a small aligned bounce buffer per thread. torch aligns tensors of 2 MiB
and more to pages when ``THP_MEM_ALLOC_ENABLE=1`` (tierflow sets it, see its ``__init__``).

Through the page cache, written data is synced and then dropped from it (``posix_fadvise``),
and so is read data: the page cache is not in the process's RSS, but it is the machine's
memory all the same, and the disk tier must not hold RAM behind the budget's back.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.page_cache import drop_from_page_cache

ALIGN = 4096  # bytes: the file offsets and memory addresses that direct I/O accepts
BOUNCE_BYTES = 1 << 20  # per I/O thread: a multiple of ALIGN

_local = threading.local()


def direct_io_supported(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened and written with ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / f".tierflow-direct-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, _bounce()[0][:ALIGN], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)


def file_bytes(tensors: Sequence[torch.Tensor], direct: bool) -> int:
    """The size of the file that holds ``tensors``: padded to ``ALIGN`` each when direct."""
    if direct:
        return sum(round_up(t.nbytes) for t in tensors)
    return sum(t.nbytes for t in tensors)


def write_tensors(path: Path, tensors: Sequence[torch.Tensor], direct: bool) -> None:
    """Store ``tensors`` (contiguous, CPU) in ``path``, replacing what it held; once this
    returns the bytes are on the device, not in the page cache."""
    if not direct:
        _write_buffered(path, tensors)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        offset = 0
        for t in tensors:
            _write_direct(fd, t, offset)
            offset += round_up(t.nbytes)
        if os.fstat(fd).st_size != offset:  # a file reused for other shapes
            os.ftruncate(fd, offset)
    finally:
        os.close(fd)


def read_tensors(path: Path, tensors: Sequence[torch.Tensor], direct: bool) -> bool:
    """Fill ``tensors`` (shaped as they were written) from ``path``; False when the file is
    shorter than they are."""
    if not direct:
        return _read_buffered(path, tensors)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = 0
        for t in tensors:
            if not _read_direct(fd, t, offset):
                return False
            offset += round_up(t.nbytes)
        return True
    finally:
        os.close(fd)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, in place. Not through numpy: exporting a storage to numpy marks it
    not resizable for good, and streamed weights resize theirs (see exec/weights.py)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("disk tensors must be contiguous CPU tensors")
    if t.nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


# ---------------------------------------------------------------------- direct


def _write_direct(fd: int, t: torch.Tensor, offset: int) -> None:
    view = tensor_bytes(t)
    start = _direct_part(t)
    _pwrite_all(fd, view[:start], offset)
    bounce, address = _bounce()
    for begin in range(start, len(view), len(bounce)):
        chunk = min(len(bounce), len(view) - begin)
        ctypes.memmove(address, t.data_ptr() + begin, chunk)
        padded = round_up(chunk)
        ctypes.memset(address + chunk, 0, padded - chunk)
        _pwrite_all(fd, bounce[:padded], offset + begin)


def _read_direct(fd: int, t: torch.Tensor, offset: int) -> bool:
    view = tensor_bytes(t)
    start = _direct_part(t)
    if not _pread_all(fd, view[:start], offset):
        return False
    bounce, address = _bounce()
    for begin in range(start, len(view), len(bounce)):
        chunk = min(len(bounce), len(view) - begin)
        if not _pread_all(fd, bounce[:round_up(chunk)], offset + begin):
            return False
        ctypes.memmove(t.data_ptr() + begin, address, chunk)
    return True


def _direct_part(t: torch.Tensor) -> int:
    """How many leading bytes of ``t`` can move without the bounce buffer."""
    if t.nbytes == 0 or t.data_ptr() % ALIGN:
        return 0
    return t.nbytes - t.nbytes % ALIGN


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written


def _pread_all(fd: int, view: memoryview, offset: int) -> bool:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            return False
        view, offset = view[got:], offset + got
    return True


def _bounce() -> tuple[memoryview, int]:
    """This thread's aligned bounce buffer and its address (an anonymous mapping: aligned to
    pages)."""
    bounce = getattr(_local, "bounce", None)
    if bounce is None:
        mapping = mmap.mmap(-1, BOUNCE_BYTES)
        bounce = (memoryview(mapping), ctypes.addressof(ctypes.c_char.from_buffer(mapping)))
        _local.bounce = bounce
    return bounce


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ``ALIGN`` blocks."""
    return -(-nbytes // ALIGN) * ALIGN


# ---------------------------------------------------------------------- page cache


def _write_buffered(path: Path, tensors: Sequence[torch.Tensor]) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(tensor_bytes(t))
        os.fdatasync(f.fileno())
        drop_from_page_cache(f.fileno())


def _read_buffered(path: Path, tensors: Sequence[torch.Tensor]) -> bool:
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            view = tensor_bytes(t)
            if f.readinto(view) != len(view):
                return False
        drop_from_page_cache(f.fileno())
    return True


