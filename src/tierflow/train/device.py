"""Where ``tierflow train`` computes: the CPU under ``--ram``, a CUDA GPU under ``--gpu`` (host
RAM below it, budgeted by ``--ram``), or the CPU planned and run as a GPU of ``--gpu`` bytes
(``--simulate-gpu``: the three-tier plans of a GPU machine, tried on a machine without one).

The loop asks this for the device of its tensors, the budgets ``tierflow.fit`` takes and the
memory figures of its ``[T]`` lines; nothing else in the loop depends on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TierflowError
from ..units import format_bytes, parse_bytes
from .options import TrainOptions


@dataclass(frozen=True)
class ComputeTier:
    device: torch.device
    simulated: bool  # a CPU run planned as on a GPU
    gpu: int | None  # the GPU's budget (real or simulated)
    ram: int | None  # host RAM's budget

    @classmethod
    def from_options(cls, opts: TrainOptions) -> "ComputeTier":
        """The tier ``opts`` ask for; one line when this machine cannot give it."""
        ram = parse_bytes(opts.ram, what="--ram") if opts.ram else None
        if opts.gpu is None:
            return cls(torch.device("cpu"), False, None, ram)
        gpu = parse_bytes(opts.gpu, what="--gpu")
        if opts.simulate_gpu:
            return cls(torch.device("cpu"), True, gpu, ram)
        if not torch.cuda.is_available():
            raise TierflowError(f"--gpu {opts.gpu} needs a CUDA GPU but torch sees none on this "
                                "machine: train on the CPU with --ram, or add --simulate-gpu "
                                "to plan and run the CPU as a GPU of that size")
        return cls(torch.device("cuda", torch.cuda.current_device()), False, gpu, ram)

    @property
    def name(self) -> str:
        if self.gpu is None:
            return "cpu"
        return "gpu (simulated on the CPU)" if self.simulated else \
            f"gpu ({torch.cuda.get_device_name(self.device)})"

    def fit_budgets(self) -> dict[str, Any]:
        """The budget arguments of ``tierflow.fit``."""
        if self.gpu is None:
            return {"ram": self.ram}
        return {"gpu": self.gpu, "ram": self.ram}

    @property
    def plan_budget(self) -> int | None:
        """The budget the plan's compute tier has."""
        return self.gpu if self.gpu is not None else self.ram

    @property
    def rss_budget(self) -> int | None:
        """The budget the process's RSS is held to: host RAM, plus a simulated GPU's."""
        if self.simulated:
            return None if self.ram is None else self.ram + self.gpu
        return self.ram

    def gpu_peak(self) -> int | None:
        """Bytes the CUDA caching allocator held at its peak (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_allocated(self.device))

    def describe(self) -> str:
        budgets = [f"{kind} {format_bytes(b)}" for kind, b in (("gpu", self.gpu),
                                                               ("ram", self.ram)) if b]
        return f"{self.name}; budgets: {', '.join(budgets) if budgets else 'none'}"
