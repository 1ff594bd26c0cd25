"""The learning-rate schedule: linear warmup, then cosine decay to ``min_lr``. No torch."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_lr: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total`` steps.

    Steps ``0 .. warmup-1`` ramp linearly up to ``lr`` (step ``warmup-1`` uses ``lr``); the
    remaining steps follow half a cosine from ``lr`` down to ``min_lr`` at the last step.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    decay = max(1, total - warmup - 1)
    progress = min(1.0, max(0.0, (step - warmup) / decay))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
