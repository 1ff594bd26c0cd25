"""The precision of a simulated run: dtypes in, bytes per parameter and activation regime out.

``--model-dtype`` (weights and gradients), ``--master`` (an fp32 copy beside low-precision
weights, or none), ``--optim-dtype`` (AdamW moments) and ``--matmul-dtype`` (what the
tensor cores or AMX run). Pure data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import TierflowError
from ..plan.placement_problem import Precision

if TYPE_CHECKING:
    from .hardware import Hardware

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "fp8": 1}
MODEL_DTYPES = ("fp32", "bf16")
MASTERS = ("none", "fp32")
OPTIM_DTYPES = ("fp32", "bf16", "int8")
MATMUL_DTYPES = ("fp32", "bf16", "fp8")
INT8_SCALE_BYTES = 2 * 4 / 256  # 2 moments x a float32 scale per block of 256 (precision/quant)


@dataclass(frozen=True)
class RunPrecision:
    model: str = "bf16"
    master: str = "fp32"
    optim: str = "fp32"
    matmul: str = "bf16"

    def __post_init__(self) -> None:
        for flag, value, allowed in (("--model-dtype", self.model, MODEL_DTYPES),
                                     ("--master", self.master, MASTERS),
                                     ("--optim-dtype", self.optim, OPTIM_DTYPES),
                                     ("--matmul-dtype", self.matmul, MATMUL_DTYPES)):
            if value not in allowed:
                raise TierflowError(f"{flag} {value!r} is unknown: use one of "
                                    f"{', '.join(allowed)}")

    @classmethod
    def default_for(cls, hw: Hardware) -> RunPrecision:
        """What tierflow trains with on ``hw``: on a GPU bf16 weights with an fp32 master
        copy; on a CPU fp32 weights, under bf16 autocast where its bf16 matmuls are the
        faster (the trainer's default follows native bf16 support: without it, bf16 runs
        in PyTorch's fallback kernels, far slower than fp32), else in fp32."""
        if hw.has_gpu:
            return cls("bf16", "fp32", "fp32", "bf16")
        matmul = "bf16" if hw.peak_flops.get("bf16", 0.0) > hw.flops("fp32") else "fp32"
        return cls("fp32", "none", "fp32", matmul)

    def bytes_per_param(self) -> Precision:
        master = 4 if self.master == "fp32" and self.model != "fp32" else 0
        width = DTYPE_BYTES[self.model]
        scales = INT8_SCALE_BYTES if self.optim == "int8" else 0.0
        return Precision(weights=width, grads=width, master=master,
                         moments=2 * DTYPE_BYTES[self.optim] + scales)

    @property
    def regime(self) -> str:
        """How activations are stored: ``fp32``; ``autocast`` (fp32 weights and residual
        stream, bf16 matmuls: the CPU trainer); or ``low`` (bf16 everywhere)."""
        if self.model == "fp32":
            return "fp32" if self.matmul == "fp32" else "autocast"
        return "low"

    def describe(self) -> str:
        p = self.bytes_per_param()
        return (f"{self.model} weights and gradients, master {self.master}, {self.optim} "
                f"moments, {self.matmul} matmuls: {p.total:g} bytes/parameter")
