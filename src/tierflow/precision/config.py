"""``PrecisionConfig``: which dtype stores the weights, master copy and AdamW moments, and
which dtype runs the matmuls; its contradictions and the bytes per parameter the planner counts.

The one precision record of a run: the trainer applies it (``apply.py``), the simulator prices
it (``sim/``) and the planner counts its bytes. Pure data, no torch: what a device can run is
probed by ``apply.check_device``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..core.errors import TierflowError

MODEL_DTYPES = ("fp32", "bf16")
MASTERS = ("fp32", "none")
OPTIM_DTYPES = ("fp32", "bf16", "int8")
MATMUL_DTYPES = ("fp32", "bf16", "fp8")
FP8_GRADS = ("bf16", "e5m2")

BLOCK = 256  # elements per int8 quantization block: one float32 scale each
_MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
# each field of PrecisionConfig and its choices (the command line's flags check them too)
CHOICES = {"model_dtype": MODEL_DTYPES, "master": MASTERS, "optim_dtype": OPTIM_DTYPES,
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
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise PrecisionError(f"{name}={value!r} is unknown: use one of "
                                     f"{', '.join(choices)}")

    def to_dict(self) -> dict[str, str]:
        """The choices by field name."""
        return asdict(self)

    @property
    def rounds_stochastically(self) -> bool:
        """Whether the optimizer draws random numbers (bf16 moments, or bf16 weights without
        a master): then it needs a generator on its parameters' device."""
        return self.optim_dtype == "bf16" or (self.master == "none" and
                                              self.model_dtype == "bf16")

    @property
    def regime(self) -> str:
        """How activations are stored: ``fp32``; ``autocast`` (fp32 weights and residual
        stream, bf16 matmuls: the CPU trainer's default where bf16 is native); or ``low``
        (bf16 weights, bf16 everywhere)."""
        if self.model_dtype == "fp32":
            return "fp32" if self.matmul_dtype == "fp32" else "autocast"
        return "low"

    def describe(self) -> str:
        """The choices and their bytes per parameter in words, e.g. ``bf16 weights and
        gradients, master fp32, fp32 moments, bf16 matmuls: 16 bytes/parameter``."""
        per = self.bytes_per_parameter()
        return (f"{self.model_dtype} weights and gradients, master "
                f"{'fp32' if per.master else 'none'}, {self.optim_dtype} moments, "
                f"{self.matmul_dtype} matmuls: {per.total:g} bytes/parameter")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionConfig:
        """The config of ``to_dict``'s fields; a one-line error for a field it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PrecisionError(f"unknown precision keys {unknown}: known keys are "
                                 f"{sorted(known)}")
        return cls(**data)

    def validate(self) -> PrecisionConfig:
        """Raise a one-line PrecisionError for a contradiction; return self so that it
        chains. What a device cannot run is ``apply.check_device``'s."""
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

