"""tierflow: train PyTorch models that do not fit in the memory you have.

``tierflow.fit(model, sample, ram="2GiB")`` returns a drop-in module that trains with the same
gradients as ``model`` inside the budget; ``tierflow.load_model(spec, disk=DIR)`` builds or
loads a Hugging Face causal LM straight onto a disk tier, for a model larger than RAM. The
planner (``tierflow.plan``) is pure data and imports no torch, so this package imports torch
only when a torch-facing name is used.

Low-precision training (``tierflow.precision``): ``PrecisionConfig`` says how weights, master
copy, AdamW moments and matmuls are stored and run; ``apply_precision(model, config)`` applies
it to a built model, ``autocast_context(config, "cpu")`` is the mode to run it under and
``make_optimizer(groups, config, lr=...)`` the AdamW that matches. For inference,
``quantize_int8(model)`` swaps a built model's linear layers for int8 ones (what ``tierflow
quantize`` writes to disk).

Importing tierflow before torch sets ``THP_MEM_ALLOC_ENABLE=1`` (unless it is set): torch then
aligns CPU tensors of 2 MiB and more to pages and backs them with huge pages where it can,
so that the disk tier can read and write them by DMA (``exec/file_io.py``) and fresh tensors
fault in 2 MiB at a time. torch reads the variable once, at its first allocation; imported
after torch, tierflow works the same, copying through a small aligned buffer instead.
"""
from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .core.errors import BudgetError, TierflowError
from .core.units import format_bytes, parse_bytes

__version__ = "0.1.0"

_LAZY = {"fit": "fitting.fit", "TierflowModule": "exec.module", "FitConfig": "core.config",
         "load_model": "exec.load",
         "PrecisionConfig": "precision", "apply_precision": "precision",
         "autocast_context": "precision", "make_optimizer": "precision",
         "quantize_int8": "models.int8"}


def __getattr__(name: str) -> Any:
    from importlib import import_module
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    if name == "precision":  # the subpackage, without importing torch before it is asked for
        return import_module(".precision", __name__)
    raise AttributeError(f"module 'tierflow' has no attribute {name!r}")


__all__ = ["fit", "TierflowModule", "FitConfig", "load_model", "PrecisionConfig",
           "apply_precision", "autocast_context", "make_optimizer", "quantize_int8",
           "BudgetError", "TierflowError", "parse_bytes", "format_bytes", "__version__"]
