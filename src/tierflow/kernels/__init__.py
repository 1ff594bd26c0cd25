"""Memory-saving compute kernels written in plain PyTorch (no custom CUDA)."""
from __future__ import annotations

from .linear_cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
