"""The stages of a Hugging Face causal LM's chain (``hf.py`` finds the parts and cuts it):
the embeddings up to decoder layer 0, one decoder layer with its side inputs from the
context, and the final norm with the fused LM head and loss.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import ChainError, Context, KernelStage


class Stop(Exception):
    """Raised by a pre-hook to end a base-model forward early."""


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states among a decoder layer's call arguments."""
    return args[0] if args else kwargs["hidden_states"]


class EmbedStage(nn.Module):
    """x (input_ids or inputs_embeds) -> the hidden states entering decoder layer 0."""

    def __init__(self, base: nn.Module, first_layer: nn.Module, input_key: str,
                 parts: dict[str, nn.Module], loose: list[nn.Parameter]):
        super().__init__()
        self.parts = nn.ModuleDict({k.replace(".", "_"): m for k, m in parts.items()})
        self.loose = nn.ParameterList(loose)  # parameters held directly by the base model
        self.input_key = input_key
        self._refs = (base, first_layer)  # a tuple: not registered, so not owned by this stage

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        base, first_layer = self._refs
        caught: list[torch.Tensor] = []

        def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
            caught.append(hidden_arg(args, kwargs))
            raise Stop

        handle = first_layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            base(**{**ctx["base_kwargs"], self.input_key: x})
        except Stop:
            pass
        finally:
            handle.remove()
        if not caught:
            raise ChainError(f"{type(base).__name__} returned without calling decoder layer 0")
        return caught[0]


def call_decoder_layer(layer: nn.Module, x: torch.Tensor, args: tuple,
                       kwargs: dict) -> torch.Tensor:
    """One decoder layer on hidden states x with the side inputs the model gives it."""
    out = layer(x, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class LayerStage(KernelStage):
    """Decoder layer ``index``: hidden -> hidden, its other arguments read from ctx."""

    def __init__(self, layer: nn.Module, index: int):
        super().__init__(layer, call_decoder_layer)
        self.index = index

    def side_inputs(self, ctx: Context) -> tuple:
        return ctx["layer_inputs"][self.index]


class HeadStage(nn.Module):
    """Final norm, then the loss when ctx has labels (logits never materialised), else logits."""

    def __init__(self, post: list[nn.Module], head: nn.Linear, chunk_tokens: int = 1024):
        super().__init__()
        self.post = nn.ModuleList(post)
        self.head = head
        self.chunk_tokens = chunk_tokens

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}"  # part of the signature: profiled per size

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        for module in self.post:
            x = module(x)
        labels = ctx.get("labels")
        if labels is None:
            return self.head(x)
        from ..kernels.linear_cross_entropy import linear_cross_entropy

        loss = linear_cross_entropy(x, self.head.weight, labels, bias=self.head.bias,
                                    chunk_tokens=self.chunk_tokens, shift=ctx["shift"])
        num_items = ctx.get("num_items_in_batch")
        if num_items is not None:  # HF: sum over tokens / num_items_in_batch
            targets = labels[..., 1:] if ctx["shift"] else labels
            loss = loss * (targets != -100).sum() / num_items
        return loss
