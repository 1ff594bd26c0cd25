"""Low-precision training: bf16 weights and moments, int8 moments, stochastic rounding, fp8
matmuls, applied to a built model as a function (the model's code stays unaware).

- ``config.py``: ``PrecisionConfig`` (model_dtype, master, optim_dtype, matmul_dtype,
  fp8_grad), its JSON round trip, ``validate()`` (contradictions and what this torch/device
  cannot run, as one-line ``PrecisionError``s) and ``bytes_per_parameter()`` for the planner.
- ``rounding.py``: unbiased stochastic rounding fp32 -> bf16 driven by a ``torch.Generator``.
- ``quant.py``: blockwise int8 storage of AdamW's moments (256 elements per float32 scale,
  square-root companding for m, fourth-root for v) and its guaranteed error bound.
- ``adamw.py``: ``AdamW``, ``torch.optim.AdamW``'s arithmetic with moments stored in fp32,
  bf16 or int8 and bf16 weights kept by an fp32 master or by stochastic rounding; its
  ``state_dict()`` is tensors and numbers only (safetensors + JSON).
- ``fp8.py``: ``Float8Linear``, an ``nn.Linear`` drop-in multiplying e4m3 operands with
  just-in-time absmax scales through ``torch._scaled_mm``; gradients in bf16 or e5m2.
- ``apply.py``: ``apply_precision(model, config)`` (the module swap), ``autocast_context``
  and ``make_optimizer``.
"""
from __future__ import annotations

from .adamw import AdamW
from .apply import apply_precision, autocast_context, make_optimizer
from .config import BytesPerParameter, PrecisionConfig, PrecisionError
from .fp8 import Float8Linear
from .rounding import stochastic_round_bf16

__all__ = ["AdamW", "BytesPerParameter", "Float8Linear", "PrecisionConfig", "PrecisionError",
           "apply_precision", "autocast_context", "make_optimizer", "stochastic_round_bf16"]
