"""The size of the world torchrun launched, read from its environment without importing torch
(the command line checks flags against it before the slow imports; ``tierflow.distributed`` joins
the world later)."""
from __future__ import annotations

import os

from .errors import TierflowError


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it; 1 without it."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(text)
    except ValueError:
        raise TierflowError(f"WORLD_SIZE={text!r} is not a whole number: launch with torchrun "
                            "--nproc-per-node N, or unset it") from None
    if size < 1:
        raise TierflowError(f"WORLD_SIZE={size} must be at least 1: launch with torchrun")
    return size
