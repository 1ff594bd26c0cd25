"""The disk tier: tensors kept in files under a directory, one file per key, and read back
into given buffers (``file_io`` moves the bytes: past the page cache where it can), plus the
one-line errors of a directory that cannot hold it (``paths.require_disk_directory`` checks
it first).

Below a GPU, a tensor on the accelerator goes through a page-locked host buffer of its size
(taken from torch's caching host allocator, which keeps it for the next transfer of that
size): copied there on a side stream (``exec/copy_stream.py``) before it is written, read
there before it is copied up.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TierflowError
from ..core.paths import require_disk_directory
from ..core.units import format_bytes
from .copy_stream import CopyAfter, SideStreamCopier
from .file_io import direct_io_supported, file_bytes, read_tensors, write_tensors
from .io_threads import transfer_thread


class DiskStore:
    """Flat files of raw tensor bytes, one per key, in ``directory``; ``direct`` says whether
    they bypass the page cache (None: whenever the file system allows it); ``device``: the
    compute tier's (tensors there are staged through host buffers)."""

    kind = "disk"

    def __init__(self, directory: str | Path, direct: bool | None = None,
                 device: torch.device | str = "cpu"):
        self.directory = Path(directory)
        require_disk_directory(self.directory)
        self.direct = direct_io_supported(self.directory) if direct is None else direct
        self.sizes: dict[str, int] = {}
        self.copier = SideStreamCopier(device)

    @property
    def bytes(self) -> int:
        """What the tier holds now: the bytes of its files."""
        return sum(self.sizes.values())

    def write(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Store ``tensors`` (contiguous) back to back under ``key``, on the device."""
        host = self._staging(tensors)
        self.copier.copy(host, tensors, after)
        try:
            write_tensors(self.directory / f"{key}.bin", host, self.direct)
        except OSError as e:
            raise _disk_error(e, self.directory) from None
        self.sizes[key] = file_bytes(tensors, self.direct)

    def read(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Fill ``tensors`` (shaped as they were written) from the file under ``key``."""
        path = self.directory / f"{key}.bin"
        host = self._staging(tensors)
        try:
            complete = read_tensors(path, host, self.direct)
        except OSError as e:
            raise _disk_error(e, self.directory) from None
        if not complete:
            raise TierflowError(f"{path} is shorter than the tensors written to it: "
                                f"the offload directory was changed during the run")
        self.copier.copy(tensors, host, after)

    def write_all(self, items: list[tuple[str, list[torch.Tensor]]],
                  after: CopyAfter = None) -> None:
        """``write`` each (key, tensors) of ``items`` (a file each, one after another)."""
        for key, tensors in items:
            self.write(key, tensors, after)

    def read_all(self, items: list[tuple[str, list[torch.Tensor]]],
                 after: CopyAfter = None) -> None:
        """``read`` each (key, tensors) of ``items``."""
        for key, tensors in items:
            self.read(key, tensors, after)

    def _staging(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` with each one on an accelerator replaced by a page-locked host buffer
        of its shape (the file's side of a transfer)."""
        return [t if t.device.type == "cpu" else
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]


class WriteBehind:
    """One writer thread for a tier's writes, the last one of each stage kept by stage, and
    at most ``limit`` of them queued: submitting one more waits for the oldest. Each pending
    write holds its tensors in memory until they are on disk, and the plan counts ``limit``
    of them, not a queue that grows for as long as the disk writes slower than the compute
    produces (measured: 2 GiB over a 4 GiB budget)."""

    def __init__(self, name: str, limit: int = 1):
        self.limit = limit
        self.writes: dict[int, Future] = {}  # stage -> its last write
        self.last: Future | None = None  # the write submitted last (it runs after the others)
        self._executor = transfer_thread(name)
        self._pending: deque[Future] = deque()

    def submit(self, stage: int, write: Callable[..., None], *args: Any) -> Future:
        """Run ``write(*args)`` on the writer thread as stage ``stage``'s write."""
        future = self._executor.submit(write, *args)
        self.writes[stage] = future
        self.last = future
        self._pending.append(future)
        while len(self._pending) > self.limit:
            self._pending.popleft().result()
        return future

    def wait(self) -> None:
        """Until every write has reached the disk (and raise a write's error)."""
        for future in list(self.writes.values()):
            future.result()

    def shutdown(self) -> None:
        self._executor.shutdown()


@contextlib.contextmanager
def scratch_directory(parent: str | Path) -> Iterator[Path]:
    """A fresh ``tierflow-<pid>-*`` directory in ``parent`` for one run's disk tier, removed
    with everything in it when the block ends (however it ends)."""
    require_disk_directory(Path(parent))
    try:
        path = Path(tempfile.mkdtemp(prefix=f"tierflow-{os.getpid()}-", dir=parent))
    except OSError as e:
        raise _disk_error(e, Path(parent)) from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _disk_error(e: OSError, directory: Path) -> TierflowError:
    if e.errno == errno.ENOSPC:
        free = os.statvfs(directory)
        return TierflowError(f"the disk tier {directory} is full "
                             f"({format_bytes(free.f_bavail * free.f_frsize)} free): free space "
                             f"there or give another directory for the disk tier")
    return TierflowError(f"disk tier {directory}: {e.strerror or e}: check the directory or give "
                         f"another one for the disk tier")
