"""Where a Hugging Face causal LM keeps its parts, found from its structure and one small run.

No family is named. One eval-mode, no-grad forward of the model on a probe (a few tokens),
with hooks, finds:

- the decoder layers: the longest ``nn.ModuleList`` (not nested in another) whose elements
  the model calls once each, in order, each on what the one before returned (so Gemma-3n's
  lists of parallel projections are not taken for its layers); in order alone if none is;
- the body: the outermost module between the model and that list that the model calls:
  ``model.base_model`` for most families, ``model.decoder`` for the decoder of an
  encoder-decoder model, ``model.model`` for Llama-4 (whose ``base_model_prefix`` names no
  attribute) and ``model.model`` of a multimodal model (its language model inside);
- the final norm ("post"): the outermost modules of the body, outside the layers, that
  first run after the last layer ended;
- the class of what the body returns (a ``ModelOutput``) and the container a layer returns
  its hidden states in (a tuple or list of that length, or none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import UnsupportedModelError


@dataclass
class Parts:
    layers_name: str
    layers: nn.ModuleList
    body_name: str
    body: nn.Module
    post: list[nn.Module]  # run in this order after the last layer, each as x = m(x)
    body_output: type  # the ModelOutput class the body returns
    layer_output: tuple[type, int] | None  # (tuple or list, its length) the layer returns, or None
    reference: Any  # the model's own output on the probe
    layer_args: list[tuple[Any, tuple, dict]]  # each layer's (hidden states, other arguments)


def decoder_layers(base: nn.Module) -> tuple[str, nn.ModuleList]:
    """The name and the list of ``base``'s decoder layers: its longest ``nn.ModuleList`` not
    nested in another one (structure only; ``find_parts`` also checks the calls)."""
    candidates = _layer_lists(base)
    if not candidates:
        from .base import ChainError
        raise ChainError(f"{type(base).__name__} has no nn.ModuleList of decoder layers: "
                         "it is not an embeddings -> layers -> norm -> head causal LM; "
                         "pass a tracer-friendly module or an nn.Sequential instead")
    return candidates[0]


def _layer_lists(root: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Non-empty ModuleLists of ``root`` not nested in another, longest first (the outermost
    first when lengths tie)."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return sorted(found, key=lambda item: -len(item[1]))


def find_parts(model: nn.Module, probe: dict[str, Any]) -> Parts:
    """Run ``model(**probe)`` once with hooks and read its parts off the calls."""
    candidates = _layer_lists(model)
    if not candidates:
        raise UnsupportedModelError(model, "it has no nn.ModuleList of decoder layers")
    inside = {id(m) for _, lst in candidates for m in lst.modules()}
    clock = [0]
    calls: dict[int, list[int]] = {}
    layer_calls: dict[int, list[int]] = {k: [] for k in range(len(candidates))}
    layer_args: dict[int, list[tuple[Any, tuple, dict]]] = {k: [] for k in range(len(candidates))}
    chained = {k: True for k in range(len(candidates))}
    last_out: dict[int, Any] = {}  # candidate -> what its latest element call returned
    layer_end: dict[int, int] = {}
    outputs: dict[int, Any] = {}

    def tick() -> int:
        clock[0] += 1
        return clock[0]

    def pre(module: nn.Module, args: tuple) -> None:
        calls.setdefault(id(module), []).append(tick())

    def layer_pre(k: int, i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            layer_calls[k].append(i)
            layer_args[k].append((args[0] if args else kwargs.get("hidden_states"),
                                  tuple(args[1:]),
                                  {n: v for n, v in kwargs.items() if n != "hidden_states"}))
            if i > 0:
                given = args[0] if args else kwargs.get("hidden_states")
                chained[k] = chained[k] and given is last_out.get(k)
        return hook

    def layer_post(k: int, last: bool):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            last_out[k] = output[0] if isinstance(output, (tuple, list)) else output
            if last:
                layer_end[k] = tick()
                outputs[id(module)] = output
        return hook

    def keep_output(module: nn.Module, args: tuple, output: Any) -> None:
        outputs[id(module)] = output

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if id(m) not in inside]
    handles += [m.register_forward_hook(keep_output) for m in model.modules()
                if id(m) not in inside]
    for k, (_, lst) in enumerate(candidates):
        handles += [layer.register_forward_pre_hook(layer_pre(k, i), with_kwargs=True)
                    for i, layer in enumerate(lst)]
        handles += [layer.register_forward_hook(layer_post(k, i == len(lst) - 1))
                    for i, layer in enumerate(lst)]
    before = [id(m) for m in model.modules()]
    try:
        with torch.no_grad():
            reference = model(**probe)
    except Exception as e:  # noqa: BLE001 - the family's own failure is the reason
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise UnsupportedModelError(model, "its own forward fails on one sequence of the sample "
                                    f"({type(e).__name__}: {first})") from e
    finally:
        for handle in handles:
            handle.remove()

    if [id(m) for m in model.modules()] != before:
        raise UnsupportedModelError(model, "its forward replaces some of its own modules as it "
                                    "runs (e.g. to switch the kind of attention by sequence "
                                    "length), so a chain cut before it runs goes stale")
    in_order = [k for k, (_, lst) in enumerate(candidates)
                if layer_calls[k] == list(range(len(lst)))]
    chosen = next((k for k in in_order if chained[k]), in_order[0] if in_order else None)
    if chosen is None:
        called = next((k for k in layer_calls if layer_calls[k]), None)
        detail = "" if called is None else (
            f"; it calls the layers of {candidates[called][0]} in the order "
            f"{layer_calls[called][:12]}")
        raise UnsupportedModelError(model, "its forward does not call a list of decoder layers "
                                    f"once each, in order{detail}")
    layers_name, layers = candidates[chosen]
    names = dict((id(m), n) for n, m in model.named_modules())
    ancestors = [layers_name.rsplit(".", depth)[0]
                 for depth in range(layers_name.count("."), 0, -1)]  # outermost first
    body_name = next((a for a in ancestors if id(model.get_submodule(a)) in calls), None)
    if body_name is None:
        raise UnsupportedModelError(model, f"its decoder layers ({layers_name}) are not inside a "
                                    "module that its forward calls (a base model)")
    body = model.get_submodule(body_name)
    end = layer_end[chosen]
    # called after the last layer (a norm may also run before the layers: NanoChat)
    late = {id(m): min(t for t in calls.get(id(m), []) if t > end) for m in body.modules()
            if id(m) not in inside and any(t > end for t in calls.get(id(m), []))}
    post = [m for m in body.modules() if id(m) in late
            and not any(id(a) in late for a in _ancestors(model, names[id(m)]) if a is not m)]
    post.sort(key=lambda m: late[id(m)])
    body_out = outputs.get(id(body))
    layer_out = outputs.get(id(layers[-1]))
    container = (type(layer_out), len(layer_out)) if isinstance(layer_out, (tuple, list)) \
        else None
    return Parts(layers_name, layers, body_name, body, post, type(body_out), container,
                 reference, layer_args[chosen])


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules on the path from ``root`` (excluded) down to ``name`` (included)."""
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]


def split_ownership(model: nn.Module, parts: Parts) -> tuple[dict[str, nn.Module],
                                                            list[nn.Parameter],
                                                            dict[str, nn.Module],
                                                            list[nn.Parameter]]:
    """Who holds which parameters: (embed modules, embed loose parameters, head modules, head
    loose parameters). The embed stage holds the body outside the layers and the final norm;
    the head holds everything of the model outside the body (the LM head, a head transform)."""
    layers_and_post = {id(parts.layers)} | {id(m) for m in parts.post}
    embed, embed_loose = _outside(parts.body, layers_and_post)
    head, head_loose = _outside(model, {id(parts.body)})
    return embed, embed_loose, head, head_loose


def _outside(root: nn.Module, exclude: set[int]) -> tuple[dict[str, nn.Module],
                                                         list[nn.Parameter]]:
    """Modules and loose parameters of ``root`` outside the ``exclude``d modules: whole
    subtrees that hold none of them, and the parameters held directly by the modules on the
    way down to them."""
    parts: dict[str, nn.Module] = {}
    loose: list[nn.Parameter] = []

    def visit(module: nn.Module, prefix: str) -> None:
        loose.extend(module.parameters(recurse=False))
        for name, child in module.named_children():
            if id(child) in exclude:
                continue
            if any(id(m) in exclude for m in child.modules()):
                visit(child, prefix + name + ".")
            else:
                parts[prefix + name] = child

    visit(root, "")
    return parts, loose
