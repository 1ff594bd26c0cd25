"""Weight casts left out of the tape: made again in backward from the weight they came from.

Under bf16 autocast a linear layer casts its fp32 weight and saves the cast (or a transposed
view of it) for the backward of its input. That copy is half the weight's bytes, about a
quarter of a Llama decoder layer's tape at seq 1024 (84 of 334 MiB for tinyllama-1.1b at
batch 2), and a tape on the disk tier writes and reads it back on every step. The weight
itself is resident again when the stage's backward runs (the executor fetches a streamed
stage's weights before its backward; the update that follows needs them), so the cast is
made again there instead: the same ``Tensor.to`` rounding gives the same bits, at the cost
of one cast per weight (30 ms for a tinyllama layer on two cores).

A saved tensor is such a cast when it is (a view of) a copy whose ``grad_fn`` is
``ToCopyBackward0`` fed straight from the accumulator of one of the stage's parameters,
with the parameter's shape and strides: anything computed from the weight beyond the cast
(scaled, quantised, transposed and then copied) stays in the tape. A frozen weight
(``requires_grad=False``, as in adapter fine-tuning) leaves no autograd history: its casts
are recognised by ``FrozenCasts``, which watches the stage's forward below autograd for
plain copies of those weights to another dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .context import AutocastMode
from .storage import storage_key


@dataclass(frozen=True)
class WeightCast:
    """A saved tensor that is a view of ``param`` cast to ``dtype``."""

    param: nn.Parameter
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        """The saved tensor again: the parameter's current values cast and viewed as saved
        (the executor updates a stage's weights only after its backward)."""
        cast = self.param.detach().to(self.dtype)  # the parameter's strides, as the forward's
        return cast.as_strided(self.shape, self.stride, self.offset)


class FrozenCasts(TorchDispatchMode):
    """While a stage's forward runs (as a context), the storages of plain casts of its
    frozen floating-point parameters, each with its parameter."""

    def __init__(self, frozen: list[nn.Parameter]):
        super().__init__()
        self._frozen = {storage_key(p): p for p in frozen}
        self.casts: dict[int, nn.Parameter] = {}

    @classmethod
    def of(cls, stage: nn.Module, autocast: AutocastMode) -> "FrozenCasts | None":
        """A recorder for ``stage`` when autocast may cast one of its frozen weights (None:
        nothing to recognise, and the forward runs without a dispatch mode)."""
        frozen = [p for p in stage.parameters() if not p.requires_grad
                  and p.is_floating_point() and p.dtype != autocast.dtype]
        return cls(frozen) if autocast.enabled and frozen else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            param = self._frozen.get(storage_key(args[0]))
            if param is not None:
                self.casts[storage_key(out)] = param
        return out


def weight_cast(t: torch.Tensor, params: set[int],
                frozen: FrozenCasts | None = None) -> WeightCast | None:
    """``t`` as a ``WeightCast`` when it is (a view of) a plain cast of a parameter whose
    ``id`` is in ``params`` (or, unchanged since, of a frozen one ``frozen`` saw cast), else
    None."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None:
        param = frozen.casts.get(storage_key(base)) if frozen is not None else None
        if param is None or base._version != 0:  # changed in place after the cast
            return None
    elif fn.name() != "ToCopyBackward0":
        return None
    else:
        source = fn.next_functions[0][0]
        param = getattr(source, "variable", None)  # set on AccumulateGrad nodes only
        if not isinstance(param, nn.Parameter) or id(param) not in params:
            return None
    if (base.shape != param.shape or base.stride() != param.stride()
            or base.storage_offset() != 0 or base.dtype == param.dtype):
        return None
    return WeightCast(param, base.dtype, t.shape, t.stride(), t.storage_offset())
