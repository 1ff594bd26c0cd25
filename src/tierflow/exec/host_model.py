"""A model that starts on a tier below the one it computes on: in host RAM under an
accelerator too small to hold it, or on the disk tier below a RAM budget.

``start_in_host_ram(model, device)`` moves each parameter's values into page-locked host
memory (a ``HostStore``, the RAM tier below the GPU) and leaves the parameter itself on the
device with an empty storage; buffers (rotary tables, masks) move to the device as they are.
``start_on_disk(model, directory)`` writes each parameter's values to the disk tier and
empties it, as ``tierflow train --disk`` builds a model there. From then on the model is
what a model built on disk is to ``fit``: stages are chained and profiled with their own
weights brought in one at a time, the planner streams the stages that do not fit, and the
others are brought in for good. The whole model is never on the compute tier beside a
stage's profile, and the lower tier holds it once (each parameter's own memory is freed as
its copy is made).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn

from .disk import DiskStore
from .host_store import HostStore
from .offload import OffloadedParameters, attach


def start_in_host_ram(model: nn.Module, device: torch.device) -> OffloadedParameters:
    """Move ``model`` onto ``device`` with its parameters' values held in host RAM (see
    the module docstring); parameters several modules share (tied embeddings) and buffers
    move to the device whole."""
    return _start_below(model, OffloadedParameters(HostStore(device)), device)


def start_on_disk(model: nn.Module, directory: str | Path) -> OffloadedParameters:
    """Move the values of ``model``'s parameters to the disk tier in ``directory`` (see the
    module docstring); parameters several modules share (tied embeddings) stay in memory."""
    return _start_below(model, OffloadedParameters(DiskStore(directory)), torch.device("cpu"))


def _start_below(model: nn.Module, offloaded: OffloadedParameters,
                 device: torch.device) -> OffloadedParameters:
    """Hand ``model``'s own parameters to ``offloaded``, leaving them empty on ``device``,
    where shared parameters and buffers move whole."""
    users = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if users[id(p)] > 1 or not p.is_contiguous():
                p.data = p.data.to(device)
            else:
                offloaded.offload(name, p, device)
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
    attach(model, offloaded)
    return offloaded
