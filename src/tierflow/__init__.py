"""tierflow: train PyTorch models that do not fit in the memory you have.

``tierflow.fit(model, sample, ram="2GiB")`` returns a drop-in module that trains with the same
gradients as ``model`` inside the budget. The planner (``tierflow.plan``) is pure data and
imports no torch, so this package imports torch only when a torch-facing name is used.
"""
from __future__ import annotations

from typing import Any

from .errors import BudgetError, TierflowError
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

_LAZY = {"fit": "api", "TierflowModule": "api", "FitConfig": "config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierflow' has no attribute {name!r}")


__all__ = ["fit", "TierflowModule", "FitConfig", "BudgetError", "TierflowError",
           "parse_bytes", "format_bytes", "__version__"]
