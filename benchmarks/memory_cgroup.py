"""A memory cgroup (cgroup v1) around benchmark children: the kernel then holds each child to
one limit on its RSS and the page cache it fills together, as a container's memory limit
does. tierflow counts the page cache in ``--ram`` itself; a peer that reads through the page
cache is held to the same terms only by such a limit. Needs root and cgroup v1's memory
controller mounted at /sys/fs/cgroup/memory.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None when one can."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (needs root)"
    return None


@dataclass
class MemoryCgroup:
    path: Path

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the cgroup (a shell moves itself in, then execs it)."""
        return ["/bin/sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh",
                *cmd]

    def reset(self) -> None:
        """Forget the peak and the count of hits of the limit (before the next child)."""
        (self.path / "memory.max_usage_in_bytes").write_text("0")
        (self.path / "memory.failcnt").write_text("0")

    def peak_bytes(self) -> int:
        """The most the children held at once since ``reset``: RSS and page cache."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def limit_hits(self) -> int:
        """How often a child reached the limit since ``reset`` (the kernel then reclaimed)."""
        return int((self.path / "memory.failcnt").read_text())


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[MemoryCgroup]:
    """A fresh cgroup limited to ``limit_bytes``, removed after (its children must be done)."""
    path = CGROUP_ROOT / f"tierflow-bench-{os.getpid()}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield MemoryCgroup(path)
    finally:
        path.rmdir()
