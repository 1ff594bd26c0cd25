"""The shape of a decoder-only LM, read from a preset or a ``config.json``: no weights, no torch.

One record for the families tierflow chains: attention (grouped-query, or DeepSeek's latent
attention) and an MLP (gated, SwiGLU-like, or two matrices), dense or a mixture of experts
(routed experts of which each token uses a few, shared experts, dense first layers), and the
parameter count of each chain stage (embeddings, one decoder layer, final norm + head).

A mixture of experts holds every expert's weights, but a token's matmuls use only the experts
routed to it: ``layer_params`` counts all of them, ``layer_matmul_params`` (what the FLOPs are
made of) and ``mlp`` (what the activations are made of) the active ones. Where dense and MoE
layers mix (DeepSeek-V3's first three), each per-layer figure is the mean over the layers,
rounded: the totals are exact to within the number of layers, a single layer's is not.

The config fields are read under transformers' names and the older aliases a config.json
may carry (``n_embd``, ``n_layer``, ...). Biases and norms follow the families this was
checked against (Llama, Mistral, Qwen2/3, Qwen2/3-MoE, Mixtral, DeepSeek-V3, GPT-2,
GPT-NeoX); other families' counts are close, not exact. A model without attention heads
(Mamba, RWKV) is counted as its intermediate-size mixer alone, a rough figure.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import TierflowError

# Families whose MLP is two matrices (up, down) rather than gated (gate, up, down).
PLAIN_MLP = ("gpt2", "gpt_neox", "gpt_neox_japanese", "gpt_bigcode", "gptj", "gpt_neo", "opt",
             "bloom", "falcon", "phi", "codegen", "starcoder2", "mpt", "biogpt", "xglm",
             "persimmon", "openai-gpt", "ctrl", "nemotron")
_FUSED_QKV = ("gpt2", "gpt_neox", "gpt_bigcode", "bloom", "falcon", "persimmon", "mpt")


@dataclass(frozen=True)
class ModelShape:
    family: str  # transformers model_type
    layers: int
    hidden: int
    mlp: int  # the MLP width a token uses per layer: intermediate size, or its active experts'
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
    gated: bool = True  # SwiGLU MLP (gate, up, down) rather than fc -> act -> proj
    # mixture of experts (experts == 0: dense)
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # routed experts a token uses
    expert_mlp: int = 0  # one routed expert's intermediate size
    shared_mlp: int = 0  # the shared experts' intermediate size, all of them together
    shared_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen)
    dense_layers: int = 0  # layers with a dense MLP of ``dense_mlp`` (the first ones)
    dense_mlp: int = 0
    # multi-head latent attention (kv_lora == 0: none)
    q_lora: int = 0  # rank of the query's low-rank projection (0: a full projection)
    kv_lora: int = 0
    rope_dim: int = 0  # per-head query/key dimensions with and without rotary embedding
    nope_dim: int = 0
    v_dim: int = 0

    def architecture(self) -> dict[str, Any]:
        """Every field but the name: what a run's measured costs depend on of the model
        (``profile/kept_profiles.py`` keys them by it)."""
        return {k: v for k, v in asdict(self).items() if k != "name"}

    @property
    def q_width(self) -> int:
        return self.heads * (self.rope_dim + self.nope_dim if self.kv_lora else self.head_dim)

    @property
    def kv_width(self) -> int:
        return self.heads * self.v_dim if self.kv_lora else self.kv_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def _attention_matmul(self) -> int:
        h = self.hidden
        if not self.kv_lora:
            return h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        q = h * self.q_width if not self.q_lora else self.q_lora * (h + self.q_width)
        kv = h * (self.kv_lora + self.rope_dim) \
            + self.kv_lora * self.heads * (self.nope_dim + self.v_dim)
        return q + kv + self.heads * self.v_dim * h

    def _mlp_matmul(self, width: int) -> int:
        return (3 if self.gated else 2) * self.hidden * width

    def _mean(self, dense: int, moe: int) -> int:
        """The mean over the layers, rounded, of a figure that is ``dense`` in a dense layer
        and ``moe`` in an MoE one."""
        if not self.experts:
            return dense
        return round((self.dense_layers * dense + self.moe_layers * moe) / self.layers)

    def layer_matmul_params(self) -> int:
        """Weights of a decoder layer that a token's matmuls use: its attention, its router
        and the experts routed to it (biases and norms excluded; MoE: mean over the layers)."""
        router = self.hidden * self.experts
        return self._attention_matmul() + self._mlp_matmul(self.mlp) \
            + self._mean(0, router)

    def largest_layer_matrix(self) -> int:
        """Elements of a decoder layer's largest weight: an MLP projection, the fused
        query-key-value projection (GPT-2, GPT-NeoX), or all the experts' projections of one
        kind (transformers keeps them in one tensor)."""
        h = self.hidden
        qkv = h * (self.q_width + 2 * self.kv_width) if self.family in _FUSED_QKV \
            else h * self.q_width
        mlp = h * (self.dense_mlp if self.experts else self.mlp)
        experts = self.experts * (2 if self.gated else 1) * h * self.expert_mlp
        return max(mlp, qkv, experts)

    def layer_params(self) -> int:
        """Every parameter of a decoder layer, each expert's (MoE: mean over the layers)."""
        h = self.hidden
        q, kv = self.q_width, self.kv_width
        biases = (q + 2 * kv) * self.qkv_bias + h * self.out_bias
        norms = 2 * h * (2 if self.norm_bias else 1) + 2 * self.head_dim * self.qk_norm \
            + self.q_lora + self.kv_lora
        dense_mlp = self.dense_mlp if self.experts else self.mlp
        dense = self._mlp_matmul(dense_mlp) \
            + ((2 * dense_mlp if self.gated else dense_mlp) + h) * self.mlp_bias
        moe = h * (self.experts + self.shared_gate) \
            + self._mlp_matmul(self.experts * self.expert_mlp + self.shared_mlp)
        return self._attention_matmul() + biases + norms + self._mean(dense, moe)

    def embed_params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    def head_params(self) -> int:
        """Final norm, plus the output projection unless tied to the embedding."""
        norm = self.hidden * (2 if self.norm_bias else 1)
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def total_params(self) -> int:
        return self.embed_params() + self.layers * self.layer_params() + self.head_params()

    def active_params(self) -> int:
        """The parameters a token's forward uses: the total less the experts not routed to it."""
        idle = self._mlp_matmul(self.experts - self.experts_per_token) * self.expert_mlp \
            if self.experts else 0
        return self.total_params() - self.moe_layers * idle


_ALIASES = {
    "hidden": ("hidden_size", "n_embd", "d_model", "emb_dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads",
              "decoder_attention_heads"),
    "mlp": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "decoder_ffn_dim"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "per_token": ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts",
                  "moe_k", "top_k"),
    "expert_mlp": ("moe_intermediate_size", "expert_ffn_hidden_size"),
    "shared": ("n_shared_experts", "moe_num_shared_experts"),
}


def _field(config: dict, key: str, default: Any = KeyError) -> Any:
    for name in _ALIASES[key]:
        if config.get(name) is not None:
            return config[name]
    if default is KeyError:
        raise KeyError(_ALIASES[key][0])
    return default


def shape_from_config(config: dict, name: str = "") -> ModelShape:
    """A ModelShape from a ``config.json`` dict (a multimodal one: its text model's); a
    one-line error for an encoder-decoder model or a config without a decoder's fields."""
    kind = config.get("model_type")
    if isinstance(config.get("text_config"), dict) and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config["text_config"].get(
            "model_type", kind)}
    if config.get("is_encoder_decoder") or kind is None:
        raise TierflowError(f"model_type {kind!r} of {name or 'the model'} is not a decoder-only "
                            "causal LM the simulator knows: give the config.json of one")
    try:
        return _shape(config, kind, name)
    except KeyError as e:
        raise TierflowError(f"config of {name or 'the model'} (model_type {kind!r}) has no "
                            f"{e.args[0]!r}: give a complete Hugging Face config.json") from None


def _shape(config: dict, kind: str, name: str) -> ModelShape:
    h = _field(config, "hidden")
    types = config.get("layers_block_type") or config.get("layer_types")
    layers = _field(config, "layers", len(types) if isinstance(types, list) else KeyError)
    heads = _field(config, "heads", 0)  # none: a state-space or RWKV model, its mixer the MLP
    kv_heads = config.get("num_key_value_heads") or config.get("num_kv_heads") \
        or (1 if config.get("multi_query") else heads)
    head_dim = config.get("head_dim") or (h // heads if heads else 0)
    vocab = config["vocab_size"]
    if kind == "gpt2":
        return ModelShape("gpt2", layers, h, config.get("n_inner") or 4 * h, heads, heads,
                          h // heads, vocab, True, positions=config["n_positions"],
                          qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                          name=name, gated=False)
    if kind == "gpt_neox":
        return ModelShape("gpt_neox", layers, h, config["intermediate_size"], heads, heads,
                          h // heads, vocab, bool(config.get("tie_word_embeddings", False)),
                          qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                          name=name, gated=False)
    dense_mlp = _field(config, "mlp", 4 * h)
    if isinstance(dense_mlp, list):  # per layer (Gemma-3n): their mean
        dense_mlp = round(sum(dense_mlp) / len(dense_mlp))
    experts = _field(config, "experts", 0) or 0
    per_token = _field(config, "per_token", 0) or 0
    moe: dict[str, Any] = {}
    mlp = dense_mlp
    if experts and per_token and config.get("enable_moe_block", True):
        expert_mlp = _field(config, "expert_mlp", dense_mlp)
        qwen_shared = config.get("shared_expert_intermediate_size") or 0
        shared = qwen_shared or (_field(config, "shared", 0) or 0) * expert_mlp
        dense_layers = config.get("first_k_dense_replace") or len(config.get("mlp_only_layers")
                                                                  or [])
        moe = dict(experts=experts, experts_per_token=per_token, expert_mlp=expert_mlp,
                   shared_mlp=shared, shared_gate=bool(qwen_shared), dense_layers=dense_layers,
                   dense_mlp=dense_mlp)
        active = per_token * expert_mlp + shared
        mlp = round((dense_layers * dense_mlp + (layers - dense_layers) * active) / layers)
    latent = {}
    if config.get("kv_lora_rank"):
        latent = dict(q_lora=config.get("q_lora_rank") or 0, kv_lora=config["kv_lora_rank"],
                      rope_dim=config["qk_rope_head_dim"], nope_dim=config["qk_nope_head_dim"],
                      v_dim=config["v_head_dim"])
    bias = bool(config.get("attention_bias", False))
    return ModelShape(kind, layers, h, mlp, heads, kv_heads, head_dim, vocab,
                      bool(config.get("tie_word_embeddings", False)),
                      qkv_bias=bias or kind in ("qwen2", "qwen2_moe"), out_bias=bias,
                      mlp_bias=bool(config.get("mlp_bias", False)),
                      qk_norm=kind in ("qwen3", "qwen3_moe"), name=name,
                      gated=kind not in PLAIN_MLP, **moe, **latent)


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


def model_config(spec: str):
    """The transformers config of a preset, or of the directory (or config.json) ``spec``
    (transformers is imported here, when a model is built)."""
    from ..models.load import read_config
    from ..models.presets import PRESETS, preset_config

    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec)
    return read_config(path if path.is_dir() else path.parent)
