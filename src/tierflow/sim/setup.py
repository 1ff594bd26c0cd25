"""One configuration to predict (``Setup``) and the precision tierflow trains with on a given
machine when none is asked (``default_precision``): what ``predict.py`` and ``tiered.py`` plan
and ``options.py`` builds from the flags of ``tierflow plan`` and ``sweep``. Pure data.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.measured import Measured
from ..precision.config import PrecisionConfig
from .hardware import Hardware
from .selection import Selection
from .shapes import ModelShape


def default_precision(hw: Hardware) -> PrecisionConfig:
    """What tierflow trains with on ``hw``: on a GPU bf16 weights with an fp32 master copy; on
    a CPU fp32 weights, under bf16 autocast where its bf16 matmuls are the faster (the
    trainer's default follows native bf16 support: without it, bf16 runs in PyTorch's
    fallback kernels, far slower than fp32), else in fp32."""
    if hw.has_gpu:
        return PrecisionConfig("bf16", "fp32", "fp32", "bf16")
    matmul = "bf16" if hw.peak_flops.get("bf16", 0.0) > hw.flops("fp32") else "fp32"
    return PrecisionConfig("fp32", "fp32", "fp32", matmul)


@dataclass(frozen=True)
class Setup:
    """One configuration to predict. Budgets in bytes; None: unlimited (the GPU's default is
    the profile's memory). ``disk``: whether a disk tier exists; ``disk_bw`` overrides the
    profile's disk read and write rates (bytes/s)."""

    shape: ModelShape
    hardware: Hardware
    seq: int
    batch: int
    grad_accum: int = 1
    gpu: int | None = None
    ram: int | None = None
    disk: bool = False
    disk_budget: int | None = None
    disk_bw: tuple[float, float] | None = None  # (read, write)
    precision: PrecisionConfig | None = None  # None: default_precision(hardware)
    selection: Selection | None = None  # what trains (--freeze/--train-only); None: all
    # whether the run clips the gradients by their global norm (``tierflow train``'s default):
    # every update then waits for the whole backward, in a pass after it
    clips: bool = True
    measured: Measured | None = None  # None: the chain's costs from the shape and hardware

    @property
    def run_precision(self) -> PrecisionConfig:
        return self.precision or default_precision(self.hardware)

    @property
    def trains(self) -> Selection:
        return self.selection or Selection.everything(self.shape)
