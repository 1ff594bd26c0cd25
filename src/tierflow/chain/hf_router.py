"""Mixture-of-experts router logits across a chain: the auxiliary loss, exactly.

With ``output_router_logits``, a transformers MoE causal LM adds
``coef * load_balancing_loss(router logits of every layer)`` to its loss. That term couples
all layers, while each chain stage sees one. So:

- a layer stage records its routers' logits (the modules the body's own
  ``_can_record_outputs["router_logits"]`` names) in ``ctx["router"]``, detached, and ties
  them to its output through ``_AttachRouterGradients``, an identity on the output;
- the head stage gives the model's own loss code all the recorded logits again
  (``RouterLogits.for_head``), so the loss is the family's own; backward keeps their gradients
  (scaled by the loss's incoming gradient);
- in the layer's backward, ``_AttachRouterGradients`` gives that gradient to the logits.

A recomputed layer records the same logits again (its RNG is replayed); the head's backward
always runs before any layer's. With no labels the head makes no loss and no logits get a
gradient: nothing is added.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class RouterLogits(dict):
    """One step's router logits: layer -> the detached logits of each of its router calls (a
    dict, so that the executor counts them among the context's bytes), and the gradients the
    head's loss gave them."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: dict[tuple[int, int], torch.Tensor] = {}

    def for_head(self, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every layer's logits, in layer and call order, for the head's loss code: tied to
        ``anchor`` (the head's hidden states), so that their gradients are in ``grads``
        before backward goes on to any layer, in a chain run as one graph too."""
        self.grads = {}
        return tuple(_Tie.apply(anchor, t, self, (i, k))
                     for i, ts in sorted(self.items()) for k, t in enumerate(ts))

    def gradient(self, layer: int, k: int) -> torch.Tensor | None:
        return self.grads.get((layer, k))


class _Tie(torch.autograd.Function):
    """The recorded logits again, as a function of the anchor (with no gradient for it): the
    gradient they get is kept for the layer's backward, which waits on the anchor's."""

    @staticmethod
    def forward(fctx: Any, anchor: torch.Tensor, logits: torch.Tensor, record: RouterLogits,
                key: tuple[int, int]) -> torch.Tensor:
        fctx.where = (record, key)
        return logits.clone()

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple:
        record, key = fctx.where
        record.grads[key] = grad
        return None, None, None, None


class _AttachRouterGradients(torch.autograd.Function):
    """Identity on the layer's output; backward also gives each of the layer's router logits
    what the head's loss gave them (no path through the layer's own output carries the
    auxiliary loss's gradient to them)."""

    @staticmethod
    def forward(fctx: Any, y: torch.Tensor, record: "RouterLogits", layer: int,
                *logits: torch.Tensor) -> torch.Tensor:
        fctx.where = (record, layer, len(logits))
        return y.view_as(y)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple:
        record, layer, n = fctx.where
        return (grad, None, None, *[record.gradient(layer, k) for k in range(n)])


def router_specs(body: nn.Module) -> list[tuple[type | None, str | None, str | None, int]]:
    """(class, class-name suffix, layer name, output index) of each router the body's
    ``_can_record_outputs`` names for ``router_logits``, as transformers reads them."""
    specs = (getattr(body, "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        return []
    out = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if isinstance(spec, str):
            out.append((None, spec, None, 1))
        elif isinstance(spec, type):
            out.append((spec, None, None, 1))
        else:  # an OutputRecorder
            out.append((spec.target_class, spec.class_name, spec.layer_name, spec.index))
    return out


def find_routers(layer: nn.Module, layer_name: str,
                 specs: list[tuple[type | None, str | None, str | None, int]]
                 ) -> list[tuple[nn.Module, int]]:
    """(module, output index) of the routers inside ``layer`` (named ``layer_name`` in the
    body), matched as transformers' output-capturing hooks match them."""
    found = []
    for name, module in layer.named_modules():
        full = f"{layer_name}.{name}" if name else layer_name
        for cls, suffix, layer_filter, index in specs:
            if not ((cls is not None and isinstance(module, cls))
                    or (suffix is not None and full.endswith(suffix))):
                continue
            if layer_filter is not None and f".{layer_filter.strip('.')}." not in f".{full}.":
                continue
            found.append((module, index))
            break
    return found


def recording(routers: list[tuple[nn.Module, int]], record: RouterLogits, layer: int
              ) -> tuple[list[torch.Tensor], list[Callable[[], None]]]:
    """Hooks on ``routers`` that record their logits for ``layer`` (detached, in ``record``)
    and collect them with their graph; returns (the collected logits, the hooks' removers)."""
    record[layer] = []
    collected: list[torch.Tensor] = []

    def hook(index: int):
        def on_output(module: nn.Module, args: tuple, output: Any) -> None:
            logits = output[index] if isinstance(output, tuple) else output
            record[layer].append(logits.detach())
            collected.append(logits)
        return on_output

    return collected, [module.register_forward_hook(hook(index)).remove
                       for module, index in routers]


def attach(y: torch.Tensor, record: RouterLogits, layer: int,
           collected: list[torch.Tensor]) -> torch.Tensor:
    """``y`` (the layer's output), through which backward reaches the collected logits with
    the head's gradients for them."""
    return _AttachRouterGradients.apply(y, record, layer, *collected)
