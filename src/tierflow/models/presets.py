"""Architecture presets: published model shapes as ``transformers`` configs, for training from
a random init without downloading anything.

``preset_config("llama-134m", vocab_size=8192)`` returns a fresh config; the vocabulary can be
overridden so that a preset trains with a tokenizer made locally. ``count_parameters(config)``
counts a config's parameters by building it on the meta device (no memory is allocated).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import TierflowError


@dataclass(frozen=True)
class Preset:
    family: str  # "llama", "qwen2" or "gpt2": the transformers model_type
    layers: int
    hidden: int
    mlp: int  # intermediate size of the MLP
    heads: int
    kv_heads: int
    vocab: int
    positions: int  # max position embeddings
    tied: bool  # lm_head shares the token embedding (as the published model does)
    about: str  # the published model the numbers come from
    extra: dict[str, Any] = field(default_factory=dict)  # further config fields


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, Preset] = {
    # the two small Llamas of ../shared/peers/peers.py (ARCHS), Llama-2 style
    "llama-20m": Preset("llama", 4, 256, 704, 4, 4, 32000, 2048, False,
                        "a 20M-parameter Llama (peers.py llama-20m)"),
    "llama-134m": Preset("llama", 12, 768, 2048, 12, 12, 32000, 2048, False,
                         "a 134M-parameter Llama (peers.py llama-134m)"),
    "tinyllama-1.1b": Preset("llama", 22, 2048, 5632, 32, 4, 32000, 2048, False,
                             "TinyLlama/TinyLlama-1.1B", {"rms_norm_eps": 1e-5}),
    "llama-tiny": Preset("llama", 2, 128, 352, 4, 4, 4096, 2048, False,
                         "a 1.5M-parameter Llama for smoke tests (tierflow compare --quick)"),
    "gpt2-124m": Preset("gpt2", 12, 768, 3072, 12, 12, 50257, 1024, True,
                        "openai-community/gpt2"),
    "qwen2.5-0.5b": Preset("qwen2", 24, 896, 4864, 14, 2, 151936, 32768, True,
                           "Qwen/Qwen2.5-0.5B",
                           {"rms_norm_eps": 1e-6, "max_window_layers": 24,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                            "bos_token_id": 151643, "eos_token_id": 151643}),
    "open-llama-3b": Preset("llama", 26, 3200, 8640, 32, 32, 32000, 2048, False,
                            "openlm-research/open_llama_3b", {"rms_norm_eps": 1e-6}),
    "llama3.2-1b": Preset("llama", 16, 2048, 8192, 32, 8, 128256, 131072, True,
                          "meta-llama/Llama-3.2-1B",
                          {"rms_norm_eps": 1e-5, "head_dim": 64, "rope_parameters": _LLAMA3_ROPE,
                           "bos_token_id": 128000, "eos_token_id": 128001}),
    "llama3-8b": Preset("llama", 32, 4096, 14336, 32, 8, 128256, 8192, False,
                        "meta-llama/Meta-Llama-3-8B",
                        {"rms_norm_eps": 1e-5,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                         "bos_token_id": 128000, "eos_token_id": 128001}),
}


def _positive(what: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise TierflowError(f"{what} {value!r} is not a positive integer: "
                            "pass a count such as 32000")


def preset_config(name: str, *, vocab_size: int | None = None, max_positions: int | None = None):
    """A fresh ``transformers`` config for preset ``name`` (sdpa attention, no KV cache, for
    training). ``vocab_size`` replaces the published vocabulary (special token ids that fall
    outside it are dropped); ``max_positions`` the maximum sequence length."""
    preset = PRESETS.get(name)
    if preset is None:
        raise TierflowError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}, "
                            "or a directory with config.json and model.safetensors")
    _positive("vocab size", vocab_size)
    _positive("max positions", max_positions)
    vocab = vocab_size or preset.vocab
    positions = max_positions or preset.positions
    extra = {k: (dict(v) if isinstance(v, dict) else v) for k, v in preset.extra.items()}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(extra.get(key), int) and extra[key] >= vocab:
            extra[key] = None
    common = dict(vocab_size=vocab, tie_word_embeddings=preset.tied, use_cache=False,
                  attn_implementation="sdpa")
    if preset.family == "gpt2":
        from transformers import GPT2Config
        ids = {k: extra.pop(k, 50256 if 50256 < vocab else None)
               for k in ("bos_token_id", "eos_token_id")}
        return GPT2Config(n_layer=preset.layers, n_embd=preset.hidden, n_inner=preset.mlp,
                          n_head=preset.heads, n_positions=positions, **ids, **common, **extra)
    shape = dict(num_hidden_layers=preset.layers, hidden_size=preset.hidden,
                 intermediate_size=preset.mlp, num_attention_heads=preset.heads,
                 num_key_value_heads=preset.kv_heads, max_position_embeddings=positions)
    if preset.family == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(**shape, **common, **extra)
    from transformers import LlamaConfig
    return LlamaConfig(**shape, **common, **extra)


def model_directory(spec: str | Path) -> Path | None:
    """None when ``spec`` names a preset; else the directory it names, which must exist (a
    one-line TierflowError if not). No torch: the command line checks ``--model`` with this
    before it imports torch."""
    if isinstance(spec, str) and spec in PRESETS:
        return None
    directory = Path(spec)
    if not directory.exists():
        raise TierflowError(f"model {str(spec)!r} is neither a preset ({', '.join(PRESETS)}) nor "
                            "an existing directory: pass a preset name or a directory with "
                            "config.json and model.safetensors")
    if not directory.is_dir():
        raise TierflowError(f"model {str(spec)!r} is a file: pass the directory that holds "
                            "config.json and model.safetensors")
    return directory


def meta_model(config):
    """The causal LM ``config`` describes, on the meta device: shapes and names, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count_parameters(config, model=None) -> int:
    """The number of distinct parameters (tied ones once) of the causal LM ``config``
    describes, counted on the meta device: nothing is allocated, even for 8B models.
    ``model``: that meta model, when the caller built it already (``meta_model``)."""
    model = meta_model(config) if model is None else model
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() yields a shared parameter once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
