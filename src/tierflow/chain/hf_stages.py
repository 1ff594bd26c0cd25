"""The embed and decoder-layer stages of a Hugging Face causal LM's chain (``hf.py`` finds
the parts and cuts it; the head stages are in ``hf_head.py``): the model's own forward up to
decoder layer 0, and one decoder layer with its side inputs from the context.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .base import ChainError, Context, KernelStage
from .hf_carry import Carry
from .hf_router import attach, recording


class Stop(Exception):
    """Raised by a pre-hook to end a model's forward early."""


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states among a decoder layer's call arguments."""
    return args[0] if args else kwargs["hidden_states"]


def model_inputs(ctx: Context, x: torch.Tensor) -> dict[str, Any]:
    """The causal LM's call arguments for this step without the labels, x as its input."""
    return {**ctx["base_kwargs"], ctx["input_key"]: x}


class EmbedStage(nn.Module):
    """x (input_ids or inputs_embeds) -> the hidden states entering decoder layer 0, as the
    model's own forward computes them (embeddings, scaling, dropout, ...); with ``carry``,
    packed with the side inputs computed from parameters (``gather`` runs the model's forward
    past the layers, passed through, to catch them)."""

    def __init__(self, model: nn.Module, first_layer: nn.Module,
                 parts: dict[str, nn.Module], loose: list[nn.Parameter],
                 carry: Carry | None = None, gather: Callable[..., Any] | None = None):
        super().__init__()
        self.parts = nn.ModuleDict({k.replace(".", "_"): m for k, m in parts.items()})
        self.loose = nn.ParameterList(loose)  # parameters held directly by the body
        self._refs = (model, first_layer)  # a tuple: not registered, so not owned by this stage
        self._carry = carry
        self._gather = gather

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        model, first_layer = self._refs
        if self._carry is not None:
            hidden, records = self._gather(ctx, x)
            return self._carry.pack(hidden, self._carry.collect(records), 0)
        caught: list[torch.Tensor] = []

        def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
            caught.append(hidden_arg(args, kwargs))
            raise Stop

        handle = first_layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            model(**model_inputs(ctx, x))
        except Stop:
            pass
        finally:
            handle.remove()
        if not caught:
            raise ChainError(f"{type(model).__name__} returned without calling decoder layer 0")
        return caught[0]


def call_decoder_layer(layer: nn.Module, x: torch.Tensor, args: tuple,
                       kwargs: dict) -> torch.Tensor:
    """One decoder layer on hidden states x with the side inputs the model gives it."""
    out = layer(x, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


class LayerStage(KernelStage):
    """Decoder layer ``index``: hidden -> hidden, its other arguments read from ctx (and from
    the boundary, for those ``carry`` brings: see hf_carry.py). When the step records router
    logits (``ctx["router"]``), its routers' logits are recorded and receive the auxiliary
    loss's gradient (see hf_router.py)."""

    def __init__(self, layer: nn.Module, index: int, routers: list[tuple[nn.Module, int]],
                 carry: Carry | None = None):
        super().__init__(layer, call_decoder_layer)
        self.index = index
        self._routers = tuple(routers)  # a tuple: the layer's own modules, not registered twice
        self._carry = carry

    def side_inputs(self, ctx: Context) -> tuple:
        return ctx["layer_inputs"][self.index]

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        args, kwargs = self.side_inputs(ctx)
        slots: dict[int, torch.Tensor] = {}
        if self._carry is not None:
            x, slots = self._carry.unpack(x, ctx, self.index)  # x: (B, T, h)
            args, kwargs = self._carry.fill(self.index, args, kwargs, slots)
        record = ctx.get("router")
        if record is None or not self._routers:
            y = self.kernel(self.module, x, args, kwargs)
        else:
            collected, removers = recording(list(self._routers), record, self.index)
            try:
                y = self.kernel(self.module, x, args, kwargs)
            finally:
                for remove in removers:
                    remove()
            y = attach(y, record, self.index, collected)
        return y if self._carry is None else self._carry.pack(y, slots, self.index + 1)
