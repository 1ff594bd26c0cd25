"""Turn a model into a Chain of stages: ``to_chain(model, sample)``.

Sources, tried in this order:
- ``nn.Sequential``: one stage per child (parameter-free children folded in), see sequential.py;
- a Hugging Face causal LM (a ``PreTrainedModel`` with output embeddings): embed, one stage per
  decoder layer, head + loss, see hf.py;
- anything ``torch.fx.symbolic_trace`` can trace: split at articulation points, see fx.py.
Anything else raises ChainError (a TypeError) naming the model and what to do.
"""
from __future__ import annotations

import sys
from typing import Any

from torch import nn

from .base import Chain, ChainError, Context, call_args, module_signature, stateful_modules

__all__ = ["Chain", "ChainError", "Context", "call_args", "module_signature", "stateful_modules",
           "to_chain"]


def _is_hf_causal_lm(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # a model cannot be a PreTrainedModel otherwise
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None


def to_chain(model: nn.Module, sample: Any, *, head_chunk_tokens: int = 1024) -> Chain:
    """Cut ``model`` into a Chain. ``sample`` is what the model is called with: a tensor, a
    tuple of positional arguments, or a dict of keyword arguments (``input_ids``, ``labels``).
    The stages hold the model's own modules and parameters. ``head_chunk_tokens``: tokens
    per chunk of a language model's fused head + loss (smaller: less memory, more overhead)."""
    if not isinstance(model, nn.Module):
        raise ChainError(f"to_chain needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Sequential):
        from .sequential import sequential_chain

        return sequential_chain(model)
    if _is_hf_causal_lm(model):
        from .hf import hf_chain

        return hf_chain(model, sample, head_chunk_tokens=head_chunk_tokens)
    from .fx import fx_chain

    return fx_chain(model, sample)
