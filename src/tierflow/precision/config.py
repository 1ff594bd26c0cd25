"""``PrecisionConfig``: which dtype stores the weights, master copy and AdamW moments, and
which dtype runs the matmuls; its validation and the bytes per parameter the planner counts.

No tensors are made here except by ``validate``'s capability probe (one tiny matmul per device
type and dtype, cached for the process).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from ..errors import TierflowError

MODEL_DTYPES = ("fp32", "bf16")
MASTERS = ("fp32", "none")
OPTIM_DTYPES = ("fp32", "bf16", "int8")
MATMUL_DTYPES = ("fp32", "bf16", "fp8")
FP8_GRADS = ("bf16", "e5m2")

BLOCK = 256  # elements per int8 quantization block: one float32 scale each
_MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
_CHOICES = {"model_dtype": MODEL_DTYPES, "master": MASTERS, "optim_dtype": OPTIM_DTYPES,
            "matmul_dtype": MATMUL_DTYPES, "fp8_grad": FP8_GRADS}


class PrecisionError(TierflowError):
    """A precision choice that contradicts itself or that this torch / device cannot run."""


@dataclass(frozen=True)
class BytesPerParameter:
    """Bytes one trainable parameter costs, by kind (activations are not per parameter).

    ``moment_scales`` is the int8 moments' float32 scales: 2 moments x 4 bytes / BLOCK
    elements = 0.03125 bytes; each parameter tensor also pads its moments to a whole block
    (at most BLOCK - 1 bytes per moment per tensor), which is not per parameter.
    """
    weights: float
    gradients: float
    master: float
    moments: float
    moment_scales: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.moments + self.moment_scales

    @property
    def optimizer_state(self) -> float:
        """What the optimizer itself holds: master copy, moments and their scales."""
        return self.master + self.moments + self.moment_scales

    @property
    def update_traffic(self) -> float:
        """Bytes of memory traffic per parameter of one AdamW update: read the gradient
        (twice, with the norm clip), read and write the states, write the weights."""
        return self.weights + 2 * self.gradients + 2 * self.optimizer_state


@dataclass(frozen=True)
class PrecisionConfig:
    """Low-precision training choices (all fp32 by default: plain PyTorch training).

    model_dtype: weight storage (and so gradient) dtype.
    master: "fp32" keeps an fp32 copy of bf16 weights in the optimizer and updates that;
        "none" updates the bf16 weights themselves with stochastic rounding.
    optim_dtype: storage of AdamW's two moments; int8 is blockwise quantized (``quant.py``).
    matmul_dtype: "bf16" runs the model under bf16 autocast; "fp8" also swaps the decoder
        layers' Linears for e4m3 ``_scaled_mm`` matmuls (``fp8.py``).
    fp8_grad: dtype of the two gradient matmuls of an fp8 Linear ("e5m2" or "bf16").
    """
    model_dtype: str = "fp32"
    master: str = "fp32"
    optim_dtype: str = "fp32"
    matmul_dtype: str = "fp32"
    fp8_grad: str = "bf16"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise PrecisionError(f"{name}={value!r} is unknown: use one of "
                                     f"{', '.join(choices)}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def rounds_stochastically(self) -> bool:
        """Whether the optimizer draws random numbers (bf16 moments, or bf16 weights without
        a master): then it needs a generator on its parameters' device."""
        return self.optim_dtype == "bf16" or (self.master == "none" and
                                              self.model_dtype == "bf16")

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype ``apply_precision`` stores floating parameters in."""
        return torch.bfloat16 if self.model_dtype == "bf16" else torch.float32

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PrecisionError(f"unknown precision keys {unknown}: known keys are "
                                 f"{sorted(known)}")
        return cls(**data)

    def validate(self, device: str | torch.device = "cpu") -> PrecisionConfig:
        """Raise a one-line PrecisionError for a contradiction or for what ``device`` (with
        this torch) cannot run; return self so that it chains."""
        if self.master == "none" and self.model_dtype == "fp32":
            raise PrecisionError("master='none' updates bf16 weights by stochastic rounding, "
                                 "but model_dtype='fp32': use model_dtype='bf16' or "
                                 "master='fp32'")
        if self.model_dtype == "bf16" and self.matmul_dtype == "fp32":
            raise PrecisionError("model_dtype='bf16' makes every matmul bf16, but "
                                 "matmul_dtype='fp32': use matmul_dtype='bf16' (or 'fp8')")
        if self.fp8_grad == "e5m2" and self.matmul_dtype != "fp8":
            raise PrecisionError(f"fp8_grad='e5m2' applies to fp8 matmuls, but matmul_dtype="
                                 f"{self.matmul_dtype!r}: use matmul_dtype='fp8' or "
                                 "fp8_grad='bf16'")
        device_type = torch.device(device).type
        uses_bf16 = "bf16" in (self.model_dtype, self.optim_dtype) or self.matmul_dtype != "fp32"
        if uses_bf16 and not _runs(device_type, "bf16"):
            raise PrecisionError(f"this {device_type} device cannot run bf16 matmuls: use "
                                 "model_dtype, optim_dtype and matmul_dtype 'fp32'")
        if self.matmul_dtype == "fp8" and not _runs(device_type, "fp8"):
            raise PrecisionError(f"matmul_dtype='fp8' needs torch._scaled_mm and float8 dtypes "
                                 f"on {device_type}, which torch {torch.__version__} lacks "
                                 "there: use matmul_dtype='bf16'")
        return self

    def bytes_per_parameter(self) -> BytesPerParameter:
        """What the planner counts per trainable parameter (DESIGN facts: fp32 everything 16;
        bf16 weights + grads + moments, no master 8; bf16 + stochastic rounding + int8
        moments 6, plus 0.03125 of int8 scales)."""
        weight = 4.0 if self.model_dtype == "fp32" else 2.0
        master = 4.0 if self.model_dtype == "bf16" and self.master == "fp32" else 0.0
        scales = 2 * 4 / BLOCK if self.optim_dtype == "int8" else 0.0
        return BytesPerParameter(weights=weight, gradients=weight, master=master,
                                 moments=2.0 * _MOMENT_BYTES[self.optim_dtype],
                                 moment_scales=scales)


@functools.cache
def _runs(device_type: str, kind: str) -> bool:
    """Whether a 16x16 matmul of ``kind`` (bf16, or fp8 through ``torch._scaled_mm``) runs on
    ``device_type``: probed once per process."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        if kind == "bf16":
            a = torch.ones(16, 16, dtype=torch.bfloat16, device=device_type)
            return bool((a @ a)[0, 0].item() == 16)
        f8 = torch.float8_e4m3fn
        a = torch.ones(16, 16, device=device_type).to(f8)
        one = torch.ones((), device=device_type)
        out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return bool(out[0, 0].item() == 16)
    except (AttributeError, RuntimeError, TypeError):
        return False
