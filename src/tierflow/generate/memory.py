"""What ``tierflow generate`` holds in RAM with every weight loaded, read from a checkpoint's
config.json and safetensors headers without loading a weight, and whether a budget holds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.safetensors_io import StoredTensor, read_header

# What the process holds beyond the planned tensors (modules imported after the baseline, the
# model's Python objects, kernel caches): about 30 MiB measured on tinyllama-1.1b, with margin.
RUNTIME_BYTES = 48 << 20


@dataclass
class MemoryNeed:
    """What generation holds at its peak, in bytes (the Python and torch runtime not counted)."""

    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def memory_needed(directory: str | Path, dtype: torch.dtype, prompt_tokens: int,
                  max_new_tokens: int) -> MemoryNeed:
    """The bytes generating ``max_new_tokens`` after ``prompt_tokens`` needs, read from the
    directory's config.json and safetensors headers without loading a weight:

    - weights: every stored float tensor's elements x ``dtype`` bytes (a tied head is stored
      once), an integer one (int8 weights of ``tierflow quantize``) at its own size;
    - KV cache: 2 x layers x kv heads x head dim x (prompt + new tokens) x ``dtype`` bytes;
    - activations (the stated margin): the prefill's fp32 logits (prompt x vocab x 4), one
      layer's working set (prompt x (4 x hidden + 2 x intermediate) x ``dtype`` bytes) and
      the attention scores (heads x prompt^2 x 4 bytes)."""
    from ..models.load import read_config
    directory = Path(directory)
    config = read_config(directory)
    size = torch.empty(0, dtype=dtype).element_size()
    weights = sum(math.prod(t.shape) * (size if t.dtype.is_floating_point else t.dtype.itemsize)
                  for t in stored_tensors(directory).values())
    layers = _config_int(config, "num_hidden_layers", "n_layer") or 0
    heads = _config_int(config, "num_attention_heads", "n_head") or 1
    kv_heads = _config_int(config, "num_key_value_heads") or heads
    hidden = _config_int(config, "hidden_size", "n_embd") or 0
    head_dim = _config_int(config, "head_dim") or hidden // heads
    inner = _config_int(config, "intermediate_size", "n_inner") or 4 * hidden
    vocab = _config_int(config, "vocab_size") or 0
    tokens = prompt_tokens + max_new_tokens
    kv = 2 * layers * kv_heads * head_dim * tokens * size
    activations = (prompt_tokens * vocab * 4 + prompt_tokens * (4 * hidden + 2 * inner) * size
                   + heads * prompt_tokens * prompt_tokens * 4)
    return MemoryNeed(int(weights), int(kv), int(activations))


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in ``directory``, by its name there."""
    from ..models.load import read_safetensors_index
    files = read_safetensors_index(directory)
    headers = {file: read_header(file) for file in set(files.values())}
    return {name: headers[file][name] for name, file in files.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name the command line uses for ``dtype``."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def fits_in_ram(need: MemoryNeed, budget: int) -> bool:
    """Whether every weight fits in RAM beside the KV cache, activations and runtime."""
    return need.total + RUNTIME_BYTES <= budget
