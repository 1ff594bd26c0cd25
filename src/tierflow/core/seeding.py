"""Seeds derived from a run's seed and names, so that parts of a run draw independent,
reproducible random streams (a module's initialization, a rank's dropout masks)."""
from __future__ import annotations

import hashlib


def derived_seed(seed: int, *names: object) -> int:
    """A 63-bit seed from ``seed`` and ``names``; equal inputs give equal seeds."""
    text = "/".join(str(part) for part in (seed, *names))
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
