"""What a caller asks of ``tierflow.fit``, checked and as one typed record."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.config import FitConfig
from ..core.errors import TierflowError
from ..core.units import parse_bytes

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class FitRequest:
    """``fit``'s keyword arguments, checked as the record is made (a TierflowError names the
    first that contradicts itself or another): budgets as given (bytes or strings), the
    optimizer factory (None: the caller steps its own), the disk tier's directory, the bytes
    the caller's optimizer holds (``reserve``, a size string parsed to bytes), micro-batches
    per update, the clipping norm, the planner's config (``planner`` names only the planner,
    merged into it)."""

    ram: int | str | None = None
    gpu: int | str | None = None
    optimizer: OptimizerFactory | None = None
    disk: str | Path | None = None
    reserve: int | str = 0  # bytes once made
    grad_accum: int = 1
    max_grad_norm: float | None = None
    config: FitConfig | None = None  # a FitConfig once made
    verbose: bool = False
    baseline: int | None = None  # the RSS a RAM budget counts from (None: fit's start)
    planner: InitVar[str] = "auto"

    def __post_init__(self, planner: str) -> None:
        config = self.config or FitConfig(planner=planner)
        if planner != "auto" and config.planner != planner:
            raise TierflowError(f"planner={planner!r} disagrees with config.planner="
                                f"{config.planner!r}: give one or the other")
        if self.grad_accum < 1:
            raise TierflowError(f"grad_accum={self.grad_accum} must be at least 1")
        norm = self.max_grad_norm
        if norm is not None and not norm > 0:
            raise TierflowError(f"max_grad_norm={norm} must be > 0 (None: no clipping)")
        if self.optimizer is None and norm is not None:
            raise TierflowError("max_grad_norm= applies to an optimizer tierflow owns: pass "
                                "optimizer= too, or clip around your own optimizer as in plain "
                                "PyTorch")
        if self.baseline is not None and self.baseline < 0:
            raise TierflowError(f"baseline={self.baseline} is negative: give the process's RSS "
                                "in bytes (e.g. right after its imports), or None")
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "reserve", parse_bytes(self.reserve, what="reserve")
                           if self.reserve else 0)

    @property
    def deferred(self) -> bool:
        """Updates after the backward: accumulation or clipping, by an owned optimizer."""
        return self.optimizer is not None and (self.grad_accum > 1
                                               or self.max_grad_norm is not None)

    @property
    def grads_resident(self) -> bool:
        """The caller accumulates gradients over micro-batches: they live the whole step."""
        return self.optimizer is None and self.grad_accum > 1


def check_model(model: nn.Module, sample: Any) -> None:
    """TierflowError unless ``model`` can train on ``sample``: no int8 layer (those are for
    generation), something that trains."""
    from ..models.int8 import Int8Linear
    int8 = next((name for name, m in model.named_modules() if isinstance(m, Int8Linear)), None)
    if int8 is not None:
        raise TierflowError(f"the model's {int8} is an int8 layer (tierflow.quantize_int8), "
                            "which is for generation: fit the model as it was before quantizing")
    args, kwargs = as_call(sample)
    if not any(p.requires_grad for p in model.parameters()) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())):
        raise TierflowError("no parameter of the model requires grad, nor does the sample: "
                            "there is nothing to train; unfreeze what should train "
                            "(p.requires_grad_(True))")


def check_tiers(request: FitRequest, host_tier: bool, disk: bool) -> None:
    """TierflowError when the request asks a tier this fit does not have: optimizer states
    on one, weights streamed from one, a disk tier without an owned optimizer."""
    config, owned = request.config, request.optimizer is not None
    if disk and not owned:
        raise TierflowError("disk= holds optimizer states and weights, which tierflow moves "
                            "only when it owns the optimizer: pass optimizer= too, or leave "
                            "disk out")
    states = config.optimizer_states
    if states != "auto" and not owned:
        raise TierflowError(f"config.optimizer_states={states!r} places the states of an "
                            "optimizer tierflow owns: pass optimizer= too, or leave it 'auto'")
    if states == "ram" and not host_tier:
        raise TierflowError("config.optimizer_states='ram' keeps them in the host RAM below a "
                            "GPU: give gpu= too (on the CPU, RAM is the compute tier: "
                            "'compute')")
    if states == "disk" and not disk:
        raise TierflowError("config.optimizer_states='disk' keeps them on the disk tier: give "
                            "disk=DIR too")
    if config.stream == "all" and not disk and not host_tier:
        raise TierflowError("config.stream='all' streams weights from the disk tier: give "
                            "disk=DIR too, or use stream='auto'")


def as_call(sample: Any) -> tuple[tuple, dict]:
    """``sample`` as the positional and keyword arguments of a call of the model."""
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}
