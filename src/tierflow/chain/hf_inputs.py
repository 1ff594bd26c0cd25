"""A Hugging Face causal LM's call arguments as a chain's (x0, ctx), and the side inputs of its
decoder layers.

``split_call`` binds the arguments to the causal LM's forward: x0 is ``input_ids`` (or
``inputs_embeds``); ctx holds the labels for the head and the other arguments for the model's
own forward. ``layer_inputs`` runs that forward with layers 0..n-2 swapped for a pass-through
and catches every layer's other arguments (causal mask, rotary cos/sin, position ids, ...)
with a pre-hook; the last layer's pre-hook stops it.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .base import ChainError, Context
from .hf_stages import Stop, hidden_arg, model_inputs

# Arguments of the causal-LM forward that the head takes (or that a chain leaves out).
_HEAD_ARGS = ("labels", "shift_labels", "logits_to_keep", "return_dict")


def split_call(signature: inspect.Signature, args: tuple, kwargs: dict, cls: str
               ) -> tuple[torch.Tensor, Context]:
    """The causal-LM call arguments -> (input_ids or inputs_embeds, ctx without layer inputs)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls} cannot be called with these arguments: {e}") from None
    arguments: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[name] = value
    arguments = {k: v for k, v in arguments.items() if v is not None}
    if arguments.get("past_key_values") is not None:
        raise ChainError(f"{cls}: past_key_values (a KV cache) is not supported in a chain; "
                         "call it without a cache for training")
    for flag in ("output_attentions", "output_hidden_states"):
        if arguments.get(flag):
            raise ChainError(f"{cls}: {flag}=True is not supported in a chain; leave it unset")
    if arguments.get("logits_to_keep", 0) not in (0, None):
        raise ChainError(f"{cls}: logits_to_keep={arguments['logits_to_keep']} is not supported "
                         "in a chain; leave it at 0 (all positions)")
    if arguments.get("return_dict") is False:
        raise ChainError(f"{cls}: return_dict=False is not supported in a chain; leave it unset")
    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    if shift_labels is not None:  # HF's loss views them flat: a slice of a batch is not
        shift_labels = shift_labels.contiguous()
    # for the model's own loss code: shift_labels alone are given as labels too, since a model
    # makes no loss without labels; its loss function then reads shift_labels (or, unshifted,
    # the labels: the decoders of encoder-decoder models)
    label_args = {"labels": shift_labels if labels is None else labels}
    if shift_labels is not None:
        label_args["shift_labels"] = shift_labels
    ctx: Context = {
        "labels": shift_labels if shift_labels is not None else labels,
        "shift": shift_labels is None,
        "label_args": label_args if labels is not None or shift_labels is not None else {},
        "num_items_in_batch": arguments.get("num_items_in_batch"),
    }
    base_kwargs = {k: v for k, v in arguments.items() if k not in _HEAD_ARGS}
    base_kwargs["use_cache"] = False
    for key in ("input_ids", "inputs_embeds"):
        if key in base_kwargs:
            x = base_kwargs.pop(key)
            ctx.update(input_key=key, base_kwargs=base_kwargs, x0=x)
            return x, ctx
    raise TypeError(f"{cls} needs input_ids or inputs_embeds, got {sorted(arguments)}")


@contextmanager
def model_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` in train or eval mode for the block, every module's own flag restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def rng_devices(*tensors: Any) -> list[torch.device]:
    return sorted({t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda},
                  key=str)


def layer_inputs(model: nn.Module, layers: nn.ModuleList, ctx: Context, x: torch.Tensor,
                 container: tuple[type, int] | None,
                 rng_states: list[torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """Run ``model`` with layers 0..n-2 passed through; catch the hidden states entering layer 0
    and every layer's other arguments. ``container``: see ``passed_through``. ``rng_states``,
    when given, receives the CPU RNG state at each layer's call."""
    n = len(layers)
    records: list[tuple[tuple, dict] | None] = [None] * n
    first: list[torch.Tensor] = []

    def catcher(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if i == 0:
                first.append(hidden_arg(args, kwargs))
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            records[i] = (tuple(args[1:]), rest)
            if rng_states is not None:
                rng_states.append(torch.get_rng_state())
            if i == n - 1:
                raise Stop
        return hook

    handles = [layer.register_forward_pre_hook(catcher(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        with passed_through(list(layers)[:-1], container):
            model(**model_inputs(ctx, x))
    except Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise ChainError(f"{type(model).__name__} did not call decoder layers {missing} of its "
                         f"{n}-layer list: cannot chain a model that skips layers")
    return first[0], records  # type: ignore[return-value]


@contextmanager
def passed_through(layers: list[nn.Module], container: tuple[type, int] | None
                   ) -> Iterator[None]:
    """``layers`` return their hidden states as they got them (in ``container``: the (tuple or
    list, length) a layer returns them first in, the rest None; None: the bare tensor)."""
    def passthrough(*args: Any, **kwargs: Any) -> Any:
        h = hidden_arg(args, kwargs)
        if container is None:
            return h
        kind, length = container
        values = [h] + [None] * (length - 1)
        return kind(*values) if hasattr(kind, "_fields") else kind(values)  # a namedtuple

    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = passthrough  # instance attribute: shadows the class's forward
    try:
        yield
    finally:
        for layer, fwd in zip(layers, saved):
            if fwd is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = fwd


def walk_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from walk_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from walk_tensors(v)
