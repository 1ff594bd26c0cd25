"""A model that starts in host RAM and trains on an accelerator too small to hold it.

``start_in_host_ram(model, device)`` moves each parameter's values into page-locked host
memory (a ``HostStore``, the RAM tier below the GPU) and leaves the parameter itself on the
device with an empty storage; buffers (rotary tables, masks) move to the device as they are.
From then on the model is what a model built on disk is to ``fit``: stages are chained and
profiled with their own weights brought up one at a time, the planner streams the stages
that do not fit from host RAM, and the others are brought up for good. The whole model is
never on the device, and host memory holds it once (each parameter's own memory is freed
as its copy is made).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .host_store import HostStore
from .offload import OffloadedParameters, attach


def start_in_host_ram(model: nn.Module, device: torch.device) -> OffloadedParameters:
    """Move ``model`` onto ``device`` with its parameters' values held in host RAM (see
    the module docstring); parameters several modules share (tied embeddings) and buffers
    move to the device whole."""
    offloaded = OffloadedParameters(HostStore(device))
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
