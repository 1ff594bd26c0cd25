"""Low-precision training: bf16 weights and moments, int8 moments, stochastic rounding, fp8
matmuls, applied to a built model as a function (the model's code stays unaware).

- ``config.py``: ``PrecisionConfig`` (model_dtype, master, optim_dtype, matmul_dtype,
  fp8_grad), the one precision record of a run, pure data: its JSON round trip,
  ``validate()`` (contradictions, as one-line ``PrecisionError``s), ``bytes_per_parameter()``
  for the planner and the simulator, and the activation ``regime``.
- ``rounding.py``: unbiased stochastic rounding fp32 -> bf16 driven by a ``torch.Generator``.
- ``quant.py``: blockwise int8 storage of AdamW's moments (256 elements per float32 scale,
  square-root companding for m, fourth-root for v) and its guaranteed error bound.
- ``adamw.py``: ``AdamW``, ``torch.optim.AdamW``'s arithmetic with moments stored in fp32,
  bf16 or int8 and bf16 weights kept by an fp32 master or by stochastic rounding; its
  ``state_dict()`` is tensors and numbers only (safetensors + JSON).
- ``fp8.py``: ``Float8Linear``, an ``nn.Linear`` drop-in multiplying e4m3 operands with
  just-in-time absmax scales through ``torch._scaled_mm``; gradients in bf16 or e5m2.
- ``apply.py``: ``check_device(config, device)`` (what this torch and device cannot run),
  ``apply_precision(model, config)`` (the module swap), ``parameter_dtype``,
  ``autocast_context`` and ``make_optimizer``.

The torch-facing names are imported when first used, so that the record (``config.py``) is
read without torch (by the simulator, say).
"""
from __future__ import annotations

from typing import Any

from .config import BytesPerParameter, PrecisionConfig, PrecisionError

_LAZY = {"AdamW": "adamw", "Float8Linear": "fp8", "stochastic_round_bf16": "rounding",
         "apply_precision": "apply", "autocast_context": "apply", "check_device": "apply",
         "make_optimizer": "apply", "parameter_dtype": "apply"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierflow.precision' has no attribute {name!r}")


__all__ = ["AdamW", "BytesPerParameter", "Float8Linear", "PrecisionConfig", "PrecisionError",
           "apply_precision", "autocast_context", "check_device", "make_optimizer",
           "parameter_dtype", "stochastic_round_bf16"]
