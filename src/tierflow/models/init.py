"""Random initialization of a preset, one module at a time, so that a model larger than the
RAM budget can be built without ever being whole in memory.

The model is built with its parameters on the meta device; then every module, children
before parents (the order of Hugging Face's own initialization), gets its own parameters
allocated and initialized by the model's ``_initialize_weights``, from a generator seeded by
``(seed, module name)``: a module's values do not depend on what was built before it, so the
model is the same however it is built. With ``place``, each parameter of a decoder layer and
of each top-level module is handed to ``place`` as soon as that module is complete (the
disk tier takes it there: ``tierflow.load_model(..., disk=DIR)``); parameters shared by
several modules (tied embeddings) are not handed over. The model knows nothing about where
its tensors go.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..core.seeding import derived_seed

# what takes a tensor of the model as soon as it is complete: (its name, the tensor)
Place = Callable[[str, torch.Tensor], None]


def initialize(model: nn.Module, seed: int, dtype: torch.dtype,
               place: Place | None = None) -> None:
    """Allocate and initialize ``model``'s meta parameters in place (see the module doc)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for module in model.modules():
        module._is_hf_initialized = False  # the meta build already "initialized" them
    blocks = _offload_units(model)
    built: dict[int, nn.Parameter] = {}  # meta parameter -> its allocated replacement
    names = {id(m): name for name, m in model.named_modules()}
    param_names: dict[int, str] = {}
    shared: set[int] = set()  # allocated parameters used by several modules: never placed
    placed: set[int] = set()

    # a loop, not a recursive closure: a closure that calls itself is a reference cycle,
    # which kept ``built`` (every parameter as first allocated) alive until a garbage
    # collection, so a model cast to bf16 after its build held its float32 copy too
    for module in _children_first(model):
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in built:
                fresh = nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                     requires_grad=p.requires_grad)
                built[id(p)] = fresh
                param_names[id(fresh)] = f"{names[id(module)]}.{name}".lstrip(".")
                if users[id(p)] > 1:
                    shared.add(id(fresh))
            setattr(module, name, built[id(p)])
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(derived_seed(seed, names[id(module)]))
            model._initialize_weights(module)
        if place is not None and id(module) in blocks:
            for p in module.parameters():
                if id(p) not in shared and id(p) not in placed:
                    placed.add(id(p))
                    place(param_names[id(p)], p)


def _children_first(module: nn.Module) -> list[nn.Module]:
    """``module`` and every module under it, each after its children, children in order
    (the order of Hugging Face's own initialization)."""
    order = [m for child in module.children() for m in _children_first(child)]
    return [*order, module]


def _offload_units(model: nn.Module) -> set[int]:
    """Modules whose parameters are placed once built: the decoder layers and the
    top-level modules that hold no decoder layer (embeddings, final norm, LM head)."""
    from ..chain.hf import decoder_layers

    base = getattr(model, "base_model", model)
    _, layers = decoder_layers(base)
    holders = [m for m in model.modules() if any(x is layers for x in m.modules())]
    held = {id(m) for m in holders}
    return {id(child) for holder in holders for child in holder.children() if id(child) not in held}
