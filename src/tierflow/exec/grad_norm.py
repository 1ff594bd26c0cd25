"""The squared L2 norm of a set of gradients, for global-norm clipping and logging."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def square_norm(grads: Iterable[torch.Tensor]) -> float:
    """Sum of the squared L2 norms of ``grads``, reduced in float32 without a squared copy
    (a copy of the 98 MB embedding gradient costs more than the reduction itself)."""
    return sum(float(torch.linalg.vector_norm(g.detach(), dtype=torch.float32)) ** 2
               for g in grads)
