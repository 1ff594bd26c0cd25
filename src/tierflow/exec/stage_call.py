"""Calling one stage, with or without the tape, and measuring what its tape holds.

Shared by the profiler and the executor, so that what is measured is what is run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .compile import is_compiled
from .context import AutocastMode
from .recast import FrozenCasts, WeightCast, weight_cast
from .selective import KeepMatmuls, run_selective
from .storage import storage_bytes, storage_key


@dataclass
class Taped:
    """A forward run with autograd: its input leaf, its output and what it saved."""

    xin: torch.Tensor  # the stage's input as an autograd leaf (or the raw input if not float)
    y: torch.Tensor  # the output, carrying the graph
    saved: dict[int, int] = field(default_factory=dict)  # storage key -> bytes, saved for backward
    policy: KeepMatmuls | None = None  # a selective forward's: what it kept and recomputed


class _SavedRecorder:
    """saved_tensors_hooks that note the storages autograd keeps.

    A tensor is kept as a detached alias (the same storage and version counter, no
    ``grad_fn``), not as itself: an op's output saved as itself holds its own node, and that
    cycle runs through C++, where only the backward breaks it. A step abandoned in its
    backward (a GPU out-of-memory error, then a retry) would keep every tape not yet
    backpropagated for as long as the process lives."""

    def __init__(self) -> None:
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            self.saved[storage_key(t)] = storage_bytes(t)
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def context_tensors(ctx: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) context: held for the whole step, never part of a tape."""
    if isinstance(ctx, torch.Tensor):
        return [ctx]
    if isinstance(ctx, dict):
        return [t for value in ctx.values() for t in context_tensors(value)]
    if isinstance(ctx, (list, tuple)):
        return [t for value in ctx for t in context_tensors(value)]
    return []


def as_leaf(x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """The stage input as a fresh autograd leaf, so the stage's graph ends at it."""
    leaf = x.detach()
    if needs_grad and leaf.is_floating_point():
        leaf.requires_grad_(True)
    return leaf


def forward_taped(stage: nn.Module, x: torch.Tensor, ctx: dict[str, Any], autocast: AutocastMode,
                  *, input_grad: bool, offload: tuple[Any, Any] | None = None,
                  selective: bool = False) -> Taped:
    """Forward with autograd; the graph reaches back only to ``xin`` and the parameters.
    ``offload``: (pack, unpack) hooks that may move saved tensors to a lower tier (see
    exec/tapes.py); what they keep in memory is what the tape holds. Casts of the stage's
    weights are left out of the tape and made again in backward (exec/recast.py).
    ``selective``: keep only the outputs of the stage's matmuls and attention and recompute
    the rest in its backward (exec/selective.py); it excludes ``offload`` and a compiled
    stage, whose hooks and kernels never see what it keeps."""
    if selective and (offload is not None or is_compiled(stage)):
        raise ValueError(f"stage {type(stage).__name__}: a selective forward keeps its tape "
                         "in the checkpoint's cache, which "
                         + ("offload hooks never see" if offload is not None
                            else "a compiled stage's kernels never see"))
    recorder = _SavedRecorder()
    move, fetch = offload if offload is not None else (None, recorder.unpack)
    params = {id(p) for p in stage.parameters()}
    # a selective forward recomputes casts of frozen weights like the rest: none to watch
    frozen = FrozenCasts.of(stage, autocast) if not (is_compiled(stage) or selective) else None

    def pack(t: torch.Tensor) -> Any:
        cast = weight_cast(t, params, frozen)
        if cast is not None:  # made again in backward, not kept (see exec/recast.py)
            return cast
        saved = move(t) if move is not None else t
        return recorder.pack(saved) if isinstance(saved, torch.Tensor) else saved

    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor() if isinstance(saved, WeightCast) else fetch(saved)

    xin = as_leaf(x, input_grad)
    policy = None
    with torch.enable_grad(), autocast(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
            frozen if frozen is not None else contextlib.nullcontext():
        if selective:
            y, policy = run_selective(stage, xin, ctx)
            recorder.saved.update(policy.saved)
        else:
            y = stage(xin, ctx)
    _check_output(stage, y)
    return Taped(xin, y, recorder.saved, policy)


def forward_plain(stage: nn.Module, x: torch.Tensor, ctx: dict[str, Any],
                  autocast: AutocastMode) -> torch.Tensor:
    """Forward without autograd: nothing is kept beyond the output."""
    with torch.no_grad(), autocast():
        y = stage(x, ctx)
    _check_output(stage, y)
    return y


def backward_taped(taped: Taped, grad_y: torch.Tensor) -> torch.Tensor | None:
    """Backpropagate through one stage: parameter gradients accumulate in ``.grad``;
    returns the gradient of the stage input (None when the input needs none)."""
    if taped.y.requires_grad:
        torch.autograd.backward(taped.y, grad_y)
    return taped.xin.grad if taped.xin.requires_grad else None


def tape_bytes(taped: Taped, params: set[int]) -> int:
    """Bytes the tape holds beyond the parameters, the input and the output."""
    exclude = params | {storage_key(taped.xin), storage_key(taped.y)}
    return sum(n for key, n in taped.saved.items() if key not in exclude)


def _check_output(stage: nn.Module, y: Any) -> None:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"stage {type(stage).__name__} returned {type(y).__name__}, "
                        f"expected one tensor")
