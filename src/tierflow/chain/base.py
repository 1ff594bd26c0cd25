"""A chain: a model cut into stages that each map one tensor to the next.

Stage i is an ``nn.Module`` whose ``forward(x, ctx)`` maps x[i] to x[i+1]. ``ctx`` holds the
step-constant side inputs (masks, rotary tables, labels) that every stage may read but that
do not travel through the chain. The chain also knows how to split the original model's call
arguments into (x[0], ctx) and how to turn the last stage's output back into what the
original model returns, so that a wrapped model is a drop-in replacement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.errors import TierflowError

Context = dict[str, Any]


class ChainError(TypeError):
    """The model (or one of its modules) cannot be cut into a chain."""


class UnsupportedModelError(ChainError, TierflowError):
    """A model family that tierflow cannot train exactly, refused before any step.

    One line that names the family (its ``model_type`` and class) and the reason; a
    TierflowError, so the CLI prints it and exits with code 2.
    """

    def __init__(self, model: nn.Module, reason: str):
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None) or "?"
        self.family = family
        self.reason = reason
        super().__init__(f"model type {family!r} ({type(model).__name__}) cannot be trained "
                         f"exactly by tierflow: {reason}")


@dataclass
class Chain:
    stages: list[nn.Module]  # stage i: forward(x, ctx) -> x[i+1]
    names: list[str]  # human-readable, e.g. "embed", "layers.3", "head+loss"
    signatures: list[str]  # equal signatures: identical computation, profiled once
    split_inputs: Callable[..., tuple[torch.Tensor, Context]]  # (*args, **kwargs) -> (x0, ctx)
    wrap_output: Callable[[torch.Tensor, Context], Any]  # (x[L], ctx) -> the model's output

    def __post_init__(self) -> None:
        if not (len(self.stages) == len(self.names) == len(self.signatures)):
            raise ValueError("stages, names and signatures must have the same length")
        if not self.stages:
            raise ChainError("a chain needs at least one stage")

    def __len__(self) -> int:
        return len(self.stages)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Plain autograd run of every stage in order: the reference the executor must match."""
        x, ctx = self.split_inputs(*args, **kwargs)
        for stage in self.stages:
            x = stage(x, ctx)
        return self.wrap_output(x, ctx)


class KernelStage(nn.Module):
    """A stage whose work is a pure function of its module, x and side inputs read from ctx.

    Stages of one signature share ``kernel``, so that compiling it once (see
    ``tierflow.exec.compile``) serves every one of them: decoder layers differ only in their
    parameters, which the compiled function takes as inputs.
    """

    def __init__(self, module: nn.Module, kernel: Callable[..., torch.Tensor]):
        super().__init__()
        self.module = module
        self.kernel = kernel

    def side_inputs(self, ctx: Context) -> tuple:
        """What the kernel needs from ctx besides x."""
        return ()

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.kernel(self.module, x, *self.side_inputs(ctx))


def module_signature(module: nn.Module, extra: str = "") -> str:
    """Identical computation => identical signature: class, structure, parameter shapes and
    each submodule's plain settings (training mode, dropout rates and other scalars its
    forward reads; a position in the model such as ``layer_idx`` is left out, so identical
    blocks share one signature)."""
    params = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                      for n, p in module.named_parameters())
    buffers = ";".join(f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers())
    return f"{type(module).__qualname__}|{module!r}|{params}|{buffers}|{_settings(module)}|{extra}"


def _settings(module: nn.Module) -> str:
    parts = []
    for name, m in module.named_modules():
        scalars = sorted((k, v) for k, v in vars(m).items()
                         if isinstance(v, (bool, int, float, str)) and not k.startswith("_")
                         and not k.endswith(("idx", "index")))
        parts.append(f"{name}:{scalars}")
    return ";".join(parts)


def call_args(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a user's ``sample`` calls the model: a tensor is one positional argument, a tuple
    (or list) is the positional arguments, a dict is keyword arguments."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    return (sample,), {}


def stateful_modules(stage: nn.Module) -> list[nn.Module]:
    """Modules of ``stage`` whose forward updates buffers in training mode (BatchNorm running
    statistics). Running such a stage twice (a recompute) updates them twice: an executor that
    recomputes it should save these modules' buffers before the recompute and restore them after.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    return [m for m in stage.modules()
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
