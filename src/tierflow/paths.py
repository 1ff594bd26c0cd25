"""Output directories checked before any slow work, so a bad path fails in one line at once."""
from __future__ import annotations

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
        raise TierflowError(f"{flag} {path} is not writable ({e.strerror or e}): choose a "
                            "directory you can write to") from None
    return path
