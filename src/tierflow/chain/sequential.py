"""``nn.Sequential`` as a chain: one stage per child, parameter-free children folded in.

A child without parameters (ReLU, Dropout, Flatten, pooling) costs little and is not worth a
stage boundary of its own, so it joins the stage before it (or, at the very start, the stage
after it). The stages hold the original children, so the chain trains the model's own
parameters.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Chain, ChainError, Context, module_signature


class SequentialStage(nn.Sequential):
    """A run of consecutive children of the original ``nn.Sequential``: forward(x, ctx)."""

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> Any:  # type: ignore[override]
        for module in self:
            x = module(x)
        return x


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def sequential_chain(model: nn.Sequential) -> Chain:
    children = list(model.named_children())
    if not children:
        raise ChainError(f"{type(model).__name__} is an empty nn.Sequential: nothing to chain")

    # Groups of (name, child): a parameterised child opens a group, a parameter-free one joins
    # the open group. Leading parameter-free children wait for the first parameterised one.
    groups: list[list[tuple[str, nn.Module]]] = []
    pending: list[tuple[str, nn.Module]] = []
    for name, child in children:
        if _has_params(child):
            groups.append(pending + [(name, child)])
            pending = []
        elif groups:
            groups[-1].append((name, child))
        else:
            pending.append((name, child))
    if pending:  # no child has parameters at all
        groups.append(pending)

    stages = [SequentialStage(*[child for _, child in group]) for group in groups]
    names = [group[0][0] if len(group) == 1 else f"{group[0][0]}-{group[-1][0]}"
             for group in groups]

    def split_inputs(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Context]:
        if len(args) + len(kwargs) != 1:
            raise TypeError(f"{type(model).__name__} takes one input, got {len(args)} positional "
                            f"and {sorted(kwargs)} keyword arguments")
        x = args[0] if args else next(iter(kwargs.values()))
        return x, {}

    return Chain(stages=stages, names=names,
                 signatures=[module_signature(s) for s in stages],
                 split_inputs=split_inputs, wrap_output=lambda x, ctx: x)
