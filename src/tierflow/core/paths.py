"""Directories checked before any slow work (before torch is imported, on the command line),
so a bad path fails in one line at once."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from .errors import TierflowError


def require_writable_dir(path: str | Path, flag: str) -> Path:
    """Create ``path`` and prove it writable; else a one-line TierflowError naming ``flag``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{time.time_ns()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise _not_writable(flag, path, e.strerror or str(e)) from None
    return path


def check_writable_dir(path: str | Path, flag: str) -> None:
    """What ``require_writable_dir`` would find, without creating or writing anything:
    ``path``, or the nearest directory above it that exists, must be a directory this user
    may write to; else the same one-line TierflowError."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = os.strerror(errno.ENOTDIR)
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = os.strerror(errno.EACCES)
    if problem is not None:
        raise _not_writable(flag, path, problem)


def _not_writable(flag: str, path: str | Path, problem: str) -> TierflowError:
    return TierflowError(f"{flag} {path} is not writable ({problem}): choose a directory you "
                         "can write to")


def require_disk_directory(directory: str | Path) -> Path:
    """``directory`` for the disk tier: it must exist and be writable (it is not created: a
    mistyped path should not fill another disk); else a one-line TierflowError naming it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TierflowError(f"disk directory {directory} does not exist: create it or give "
                            f"another directory for the disk tier")
    if not os.access(directory, os.W_OK):
        raise TierflowError(f"disk directory {directory} is not writable: give a directory "
                            f"you can write to for the disk tier")
    return directory
