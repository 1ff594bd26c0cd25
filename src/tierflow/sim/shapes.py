"""The shape of a decoder-only LM, read from a preset or a ``config.json``: no weights, no torch.

One record for the families tierflow chains (Llama, Mistral, Qwen2/3 with gated MLPs and
RMSNorm; GPT-2 and GPT-NeoX with plain MLPs, LayerNorm and biases), and the exact parameter
count of each chain stage (embeddings, one decoder layer, final norm + head).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import TierflowError

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = (*_LLAMA_LIKE, "gpt2", "gpt_neox")


@dataclass(frozen=True)
class ModelShape:
    family: str  # transformers model_type
    layers: int
    hidden: int
    mlp: int  # intermediate size
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the LM head shares the token embedding
    positions: int = 0  # learned position embeddings (GPT-2), else 0
    qkv_bias: bool = False
    out_bias: bool = False  # attention output projection bias
    mlp_bias: bool = False
    norm_bias: bool = False  # LayerNorm (bias) instead of RMSNorm
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    name: str = ""

    @property
    def gated(self) -> bool:
        """SwiGLU MLP (gate, up, down) rather than fc -> GELU -> proj."""
        return self.family in _LLAMA_LIKE

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that take part in matmuls (biases and norms excluded)."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.mlp
        return h * q + 2 * h * kv + q * h + (3 if self.gated else 2) * h * i

    def largest_layer_matrix(self) -> int:
        """Elements of a decoder layer's largest weight: an MLP projection, or the fused
        query-key-value projection of GPT-2 and GPT-NeoX."""
        h = self.hidden
        qkv = h * (self.q_width + 2 * self.kv_width) if self.family in ("gpt2", "gpt_neox") \
            else h * self.q_width
        return max(h * self.mlp, qkv)

    def layer_params(self) -> int:
        """Every parameter of one decoder layer."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.mlp
        biases = (q + 2 * kv) * self.qkv_bias + h * self.out_bias
        biases += ((2 * i if self.gated else i) + h) * self.mlp_bias
        norms = 2 * h * (2 if self.norm_bias else 1) + 2 * self.head_dim * self.qk_norm
        return self.layer_matmul_params() + biases + norms

    def embed_params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    def head_params(self) -> int:
        """Final norm, plus the output projection unless tied to the embedding."""
        norm = self.hidden * (2 if self.norm_bias else 1)
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def total_params(self) -> int:
        return self.embed_params() + self.layers * self.layer_params() + self.head_params()


def shape_from_config(config: dict, name: str = "") -> ModelShape:
    """A ModelShape from a ``config.json`` dict; a one-line error for an unknown family."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise TierflowError(f"model_type {kind!r} of {name or 'the model'} is not one the "
                            f"simulator knows: use a {', '.join(FAMILIES)} config")
    try:
        if kind == "gpt2":
            h = config["n_embd"]
            return ModelShape("gpt2", config["n_layer"], h, config.get("n_inner") or 4 * h,
                              config["n_head"], config["n_head"], h // config["n_head"],
                              config["vocab_size"], True, positions=config["n_positions"],
                              qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                              name=name)
        h, heads = config["hidden_size"], config["num_attention_heads"]
        if kind == "gpt_neox":
            return ModelShape("gpt_neox", config["num_hidden_layers"], h,
                              config["intermediate_size"], heads, heads, h // heads,
                              config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                              qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                              name=name)
        bias = bool(config.get("attention_bias", False))
        return ModelShape(kind, config["num_hidden_layers"], h, config["intermediate_size"],
                          heads, config.get("num_key_value_heads") or heads,
                          config.get("head_dim") or h // heads, config["vocab_size"],
                          bool(config.get("tie_word_embeddings", False)),
                          qkv_bias=bias or kind == "qwen2", out_bias=bias,
                          mlp_bias=bool(config.get("mlp_bias", False)),
                          qk_norm=kind == "qwen3", name=name)
    except KeyError as e:
        raise TierflowError(f"config of {name or 'the model'} has no {e.args[0]!r}: give a "
                            f"complete Hugging Face config.json") from None


def load_shape(spec: str) -> ModelShape:
    """The shape of a preset name or of a directory holding ``config.json``."""
    from ..models.presets import PRESETS
    preset = PRESETS.get(spec)
    if preset is not None:
        if preset.family == "gpt2":
            config = {"model_type": "gpt2", "n_embd": preset.hidden, "n_layer": preset.layers,
                      "n_inner": preset.mlp, "n_head": preset.heads,
                      "vocab_size": preset.vocab, "n_positions": preset.positions}
        else:
            config = {"model_type": preset.family, "hidden_size": preset.hidden,
                      "num_hidden_layers": preset.layers, "intermediate_size": preset.mlp,
                      "num_attention_heads": preset.heads, "num_key_value_heads": preset.kv_heads,
                      "vocab_size": preset.vocab, "tie_word_embeddings": preset.tied,
                      "head_dim": preset.extra.get("head_dim")}
        return shape_from_config(config, spec)
    path = Path(spec)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise TierflowError(f"--model {spec!r} is neither a preset nor a directory with "
                            f"config.json: use a preset ({', '.join(PRESETS)}) or such a "
                            f"directory")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise TierflowError(f"cannot read {file} as JSON ({e}): give a Hugging Face "
                            f"config.json") from None
    if not isinstance(config, dict):
        raise TierflowError(f"{file} is not a JSON object: give a Hugging Face config.json")
    return shape_from_config(config, str(spec))
