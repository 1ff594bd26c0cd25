"""Where a fit starts: the compute tier and its budget, the tiers below it, where the
model's weights wait (host RAM below a GPU, the disk tier below a RAM budget), and what the
process holds before anything is profiled."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import TierflowError
from ..core.units import parse_bytes
from ..exec.context import AutocastMode
from ..exec.host_model import start_in_host_ram, start_on_disk
from ..exec.memory import EXACT_THRESHOLD, configure_host_allocator, meter_for, return_free_memory
from ..exec.offload import OffloadedParameters, offloaded_parameters
from ..exec.stage_call import storage_key
from ..exec.storage import TensorStore
from ..plan.tier_costs import LowerTier
from .request import FitRequest, as_call, check_tiers
from .tiers import lower_tiers


@dataclass
class FitStart:
    """The compute tier (``tier``: "ram", "gpu" or "gpu (simulated)") on ``device`` and its
    ``budget``; the ``lower`` tiers (with an owned optimizer) and the ``disk`` directory;
    where the weights wait (``offloaded``; None: in memory); the bytes of weights above the
    budget the caller held in RAM (``came_in_ram``); whether memory is measured with malloc's
    exact thresholds (``exact_host``: a RAM budget); the meter's reading when fit began
    (``before``), the RSS the budget does not cover (``outside_budget``) and what the budget
    covers of the RSS before fit besides the parameters (``held_before``); the caller's
    autocast mode; what fit says (``log``). ``stores``: each lower tier's store, by name."""

    device: torch.device
    tier: str
    budget: int | None
    lower: list[LowerTier]
    stores: dict[str, TensorStore]
    disk: str | Path | None
    offloaded: OffloadedParameters | None
    came_in_ram: int
    exact_host: bool
    before: int
    outside_budget: int
    held_before: int
    autocast: AutocastMode
    say: Callable[[str], Any]
    log: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def weights_from(self) -> tuple[LowerTier, ...] | None:
        """The tier a model built below the compute tier streams its weights from (None:
        it started in memory, and may stream from any)."""
        if self.offloaded is None:
            return None
        return tuple(t for t in self.lower if self.stores[t.name] is self.offloaded.store)


def start_fit(model: nn.Module, sample: Any, request: FitRequest) -> FitStart:
    """Put ``model`` where the request says it waits and measure what the process holds."""
    config = request.config
    if request.gpu is not None and not config.simulated_gpu:
        target = sample_device(sample)
        if device_of(model).type == "cpu" and target.type != "cpu":
            # computes on the GPU, never whole there: streamed from host RAM, or from disk
            built_on_disk = offloaded_parameters(model)
            if built_on_disk is None:
                start_in_host_ram(model, target)
            else:
                built_on_disk.move_model(model, target)
    device = device_of(model)
    tier, budget, ram_below = compute_budget(device, request, config.simulated_gpu)
    offloaded = offloaded_parameters(model)
    disk = request.disk
    if offloaded is not None and disk is None and offloaded.store.kind == "disk":
        disk = offloaded.store.directory  # the model's own disk tier
    host_tier = tier != "ram"  # under a GPU, real or simulated, host RAM is the next tier
    check_tiers(request, host_tier, disk is not None)
    came_in_ram = 0
    if disk is not None and offloaded is None and budget is not None and tier == "ram":
        # as `tierflow train --disk` builds a model: its weights wait on disk and each stage
        # is profiled with its own alone, never the whole model beside a stage's profile
        held = _held(model)
        came_in_ram = held if held > budget else 0
        offloaded = start_on_disk(model, disk)
    lower, stores = lower_tiers(device, disk, ram_below, host_tier, offloaded) \
        if request.optimizer else ([], {})
    exact_host = budget is not None and tier == "ram"
    if exact_host:
        configure_host_allocator(EXACT_THRESHOLD)  # freed memory leaves the RSS at once
    log: list[str] = []
    say = (lambda m: (log.append(m), print(f"[tierflow] {m}", flush=True))) \
        if request.verbose else log.append
    autocast = AutocastMode.capture(device.type)
    if device.type == "cpu":
        return_free_memory()  # what malloc cached before fit is not the process's to keep
    before = meter_for(device).current()  # what the first runs leave resident counts from here
    # the RSS the budget does not cover: the process itself, less the parameters it holds, or
    # the caller's baseline, above which what the process holds is the plan's
    outside = before - _held(model)
    if request.baseline is not None and tier == "ram":
        outside = min(outside, request.baseline)
    return FitStart(device, tier, budget, lower, stores, disk, offloaded, came_in_ram,
                    exact_host, before, outside, before - _held(model) - outside, autocast,
                    say, log)


def _held(model: nn.Module) -> int:
    """Bytes of the parameters' storages in memory (each storage once)."""
    return sum({storage_key(p): p.untyped_storage().nbytes()
                for p in model.parameters()}.values())


def compute_budget(device: torch.device, request: FitRequest,
                   simulated: bool) -> tuple[str, int | None, int | None]:
    """The compute tier's name and budget and the budget of host RAM below it (None: no
    host tier): ``ram`` on the CPU; ``gpu`` over ``ram`` on an accelerator or a simulated
    GPU."""
    ram, gpu = request.ram, request.gpu
    parse = lambda value, what: None if value is None else parse_bytes(value, what=what)  # noqa: E731
    if device.type == "cpu" and not simulated:
        if gpu is not None:
            raise TierflowError(f"gpu={gpu!r} was given but the model and the sample are on "
                                "the CPU: give the sample on the GPU (the model may stay in "
                                "host RAM), give ram= instead, or simulate a GPU with "
                                "config=FitConfig(simulated_gpu=True)")
        return "ram", parse(ram, "ram budget"), None
    if device.type == "cpu" and gpu is None:
        raise TierflowError("FitConfig(simulated_gpu=True) needs gpu=: the budget of the "
                            "simulated GPU")
    name = "gpu (simulated)" if device.type == "cpu" else "gpu"
    return name, parse(gpu, "gpu budget"), parse(ram, "ram budget")


def sample_device(sample: Any) -> torch.device:
    """The device of the sample's first tensor (the CPU when it has none)."""
    args, kwargs = as_call(sample)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def device_of(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise TierflowError(f"the model's parameters are on several devices "
                            f"({', '.join(sorted(map(str, devices)))}): move it to one device "
                            "first")
    return devices.pop() if devices else torch.device("cpu")
