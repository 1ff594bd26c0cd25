"""What profiling the fused LM head in chunks of N tokens would take, known before it runs.

``fit`` plans a Hugging Face causal LM twice when memory binds: with the head's logits in
chunks of 1024 tokens (faster) and of 256 (``plan/tier_search.auto_head_chunk``). Each plan
starts with a profile of the head, and the 1024-token profile holds its chunk's logits
several times over beside the head's weight: with llama-134m (vocab 32000, seq 512, batch
2) on the disk tier, `fit` under ``ram="360MiB"`` peaked at 478.9 MiB before it chose
256-token chunks (``benchmarks/frozen_budget.py --built-on-disk`` at 56d0458).
``head_profile_bytes`` prices that profile from the shapes alone, with the measured factors
of ``HEAD_TRANSIENT`` (which the simulator's ``sim/stages.py`` prices the head with too), so
that a chunk whose profile would pass the budget is never run. torch is imported when a
model is priced: the factors are read without it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

LOGIT_BYTES = 4  # the loss reads float32 logits in every precision
# The fused head's chunk logits (fp32) while a forward runs, as a multiple of chunk x vocab x
# 4 bytes, by precision regime, (with its tape, without): measured 1.34 with autocast, 0.84
# in fp32; without tape 2.97 and 1.97
HEAD_TRANSIENT = {"fp32": (0.85, 2.0), "autocast": (1.35, 3.0), "low": (1.35, 3.0)}


def head_profile_bytes(model: nn.Module, sample: Any, chunk_tokens: int) -> int | None:
    """Bytes a profile of ``model``'s fused LM head in chunks of ``chunk_tokens`` tokens
    holds at its peak: the head's weights and the most any precision's transients take per
    byte of a chunk's float32 logits. None when ``model`` has no linear head or the sample
    no token ids (nothing is chunked then)."""
    from torch import nn

    output = getattr(model, "get_output_embeddings", None)
    head = output() if callable(output) else None
    tokens = _tokens(sample)
    if not isinstance(head, nn.Linear) or tokens is None:
        return None
    logits = min(chunk_tokens, tokens) * head.out_features * LOGIT_BYTES
    transient = max(nograd for _taped, nograd in HEAD_TRANSIENT.values())
    weights = sum(p.nbytes for p in head.parameters())
    return weights + int(transient * logits)


def _tokens(sample: Any) -> int | None:
    """Tokens in the sample's ``input_ids`` (or ``labels``): batch x sequence."""
    import torch

    if not isinstance(sample, Mapping):
        return None
    for key in ("input_ids", "labels"):
        value = sample.get(key)
        if isinstance(value, torch.Tensor):
            return value.numel()
    return None
