"""Compile the stages that share a kernel, once per kernel, with torch.compile.

Only ``KernelStage`` stages are compiled: their kernel is a free function of (module, x,
side inputs), so dynamo treats the module's parameters as inputs and the twelve decoder
layers of a model share one graph and one compiled backward. Autocast and the saved-tensor
hooks are entered outside the compiled function (inside, they would defeat the caches).
Compiled kernels fuse element-wise work and may recompute cheap ops in backward, so results
differ from eager within floating-point rounding; dropout draws from the same generator,
so a recomputation that restores the RNG state reproduces its masks.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..chain.base import Chain, KernelStage

_COMPILED: dict[Callable, Callable] = {}


def compile_chain(chain: Chain) -> int:
    """Swap each KernelStage's kernel for its compiled version; returns how many stages."""
    count = 0
    for i, stage in enumerate(chain.stages):
        if isinstance(stage, KernelStage):
            stage.kernel = compiled(stage.kernel)
            # compiled code keeps other tensors for backward: profile it apart from eager
            chain.signatures[i] += "|compiled"
            count += 1
    return count


def is_compiled(stage: torch.nn.Module) -> bool:
    """Whether ``stage`` runs a compiled kernel (``compile_chain`` swapped it in)."""
    return isinstance(stage, KernelStage) and stage.kernel in _COMPILED.values()


def compiled(kernel: Callable) -> Callable:
    """The one compiled version of ``kernel`` in this process (itself if already compiled)."""
    if kernel in _COMPILED.values():
        return kernel
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, dynamic=False)
    return _COMPILED[kernel]
