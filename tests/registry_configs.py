"""Tiny configurations of every model type in transformers' causal-LM mapping, for the registry
test (test_registry.py): 2-4 layers, hidden 64, vocab 256, a few experts.

``tiny_model(model_type)`` builds one: the family's config class with its defaults, the sizes
of ``SIZES`` for the fields it has, one layer of each of its layer types, dropout on where it
has dropout, router logits (and so the auxiliary loss) on where it has routers, its parts
(a text config, an attention config, ...) made tiny the same way, then the family's own
fixes from ``OVERRIDES`` where the generic sizes are inconsistent for it, and what a user
does before training it (``PREPARE``). A multimodal ``...ForConditionalGeneration`` is built
through its text model's causal LM, as its text part is fine-tuned; a causal LM that
transformers declares on a text config (Llama-4, Mllama) is built on that config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB = 256
DROPOUT = 0.1

# Generic tiny sizes, applied to the fields a config has.
SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    n_embd=64, n_layer=2, n_head=4, n_positions=64, d_model=64, num_layers=2, n_layers=2,
    ffn_dim=128, decoder_ffn_dim=128, decoder_layers=2, decoder_attention_heads=4,
    encoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4, embedding_size=64,
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_shared_experts=1,
    expert_ffn_hidden_size=32, dense_intermediate_size=128, first_k_dense_replace=1,
    n_group=2, topk_group=1, intermediate_size_mlp=128,
    # multi-head latent attention
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=4,
    # linear attention and state-space layers
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_head_dim=16, linear_num_heads=4, mamba_d_state=8,
    ssm_state_size=8, state_size=8,
    mamba_chunk_size=8, chunk_size=8, time_step_rank=8, mamba_dt_rank=8, mamba_n_heads=8,
    mamba_d_head=16, mamba_d_ssm=128, use_mamba_kernels=False,
    # attention windows shorter than the test's sequences
    sliding_window=4, attention_chunk_size=4, rotary_dim=8,
    # per-layer embeddings
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

# The family's own fixes where the generic sizes do not fit it.
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": dict(attn_layer_indices=[1]),
    "blt": dict(vocab_size=260, encoder_hash_byte_group_vocab=512, patch_size=2,
                local_attention_window_len=4),
    "blt/decoder_config": dict(vocab_size=260, hidden_size_global=64),
    "blt/encoder_config": dict(vocab_size=260, hidden_size_global=64, num_hidden_layers=1),
    "blt/patcher_config": dict(vocab_size=260),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default",
                                                                         rope_theta=10000.0)}),
    "cpmant": dict(prompt_length=4, prompt_types=3),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=32)),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),
    "diffllama": dict(attention_dropout=0.0),  # refused by its config: no dropout semantics
    "dots3_note_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=32, swa_kv_lora_rank=16, swa_head_dim=16,
                            swa_qk_nope_head_dim=8, swa_v_head_dim=16,
                            shared_experts_intermediate_size=32),
    "flint": dict(mlp_only_layers=[0]),
    # its text part has no per-layer embeddings, as its config requires
    "gemma4_assistant/text": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=16,
                         vocab_size_per_layer_input=VOCAB),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "granitemoehybrid": dict(layer_types=["linear_attention", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8),
    "moshi": dict(audio_vocab_size=32),
    "moshi/depth_decoder_config": dict(audio_vocab_size=32, input_size=64),
    "musicgen_decoder": dict(num_codebooks=2),
    "musicgen_melody_decoder": dict(num_codebooks=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=2),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64,
                            attention_window_size=4),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[4, 4],
                     axial_pos_embds_dim=[32, 32], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, num_buckets=2),
    "xlstm": dict(num_heads=4),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}


# What a user does before training the family's model.
PREPARE: dict[str, Callable[[torch.nn.Module], Any]] = {
    "xmod": lambda model: model.set_default_language("en_XX"),  # its adapters' language
}


@dataclass
class Tiny:
    model: torch.nn.Module
    via: str  # the model type actually built (a composite's text model), or ""


def _text_type(config_cls: type) -> str:
    """The model type of a composite config's text part, as transformers declares it."""
    spec = getattr(config_cls, "sub_configs_defaults", {}).get("text_config")
    if spec is not None and getattr(spec, "model_type", None):
        return spec.model_type
    return type(config_cls().text_config).model_type


def _resolve(model_type: str) -> tuple[type, type, str]:
    """(config class, causal-LM class, via) for ``model_type``. A causal LM declared on a text
    config (Llama-4, Mllama, MusicGen's decoder, ...) is built on it; a multimodal
    ``...ForConditionalGeneration`` through its text model's own causal LM."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as LM

    config_cls = CONFIG_MAPPING[model_type]
    lm_cls = getattr(transformers, LM[model_type])
    own = lm_cls.config_class
    if own is not config_cls:
        return own, lm_cls, own.model_type
    if "ConditionalGeneration" in lm_cls.__name__:
        text_type = _text_type(config_cls)
        return CONFIG_MAPPING[text_type], getattr(transformers, LM[text_type]), text_type
    return config_cls, lm_cls, ""


def _tiny_kwargs(config_cls: type, key: str) -> dict[str, Any]:
    """Keyword arguments that make ``config_cls`` tiny (``key``: its OVERRIDES entry); a
    text part of a composite config is made tiny the same way (its entry: ``key/text``)."""
    from transformers import CONFIG_MAPPING

    default = config_cls() if "text_config" not in getattr(config_cls, "sub_configs", {}) \
        else None
    fields = default.to_dict() if default is not None else {}
    names = set(fields) | set(getattr(config_cls, "attribute_map", {}))
    kwargs = {k: v for k, v in SIZES.items() if k in names}
    if "kv_lora_rank" in names:  # latent attention: a key per head, rotary on the rope part
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]
        if "head_dim" in names:
            kwargs["head_dim"] = SIZES["qk_rope_head_dim"]
    types = fields.get("layer_types")
    if isinstance(types, list) and types:  # one layer of each type, in the family's order
        distinct = list(dict.fromkeys(types))
        kwargs["layer_types"] = distinct if len(distinct) > 1 else distinct * 2
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    for name, value in fields.items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name) \
                and "layerdrop" not in name:
            kwargs[name] = DROPOUT
    if "output_router_logits" in names:
        kwargs["output_router_logits"] = True
    if "router_jitter_noise" in names:
        kwargs["router_jitter_noise"] = 0.01
    if default is None:  # a composite built whole: its text part tiny
        text_type = _text_type(config_cls)
        kwargs["text_config"] = dict(_tiny_kwargs(CONFIG_MAPPING[text_type], f"{key}/text"),
                                     model_type=text_type)
    for name, sub in getattr(config_cls, "sub_configs", {}).items():  # its other parts tiny
        if name != "text_config" and name in fields and isinstance(sub, type) \
                and getattr(sub, "model_type", None) is not None and sub.__name__ != "AutoConfig":
            kwargs[name] = _tiny_kwargs(sub, f"{key}/{name}")
    kwargs.update(OVERRIDES.get(key, {}))
    return kwargs


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (its text model's for a multimodal one), the class of
    the causal LM to build on it, and the model type built instead, if any."""
    config_cls, lm_cls, via = _resolve(model_type)
    return config_cls(**_tiny_kwargs(config_cls, via or model_type)), lm_cls, via


def tiny_model(model_type: str, seed: int = 0) -> Tiny:
    """A tiny, randomly initialised causal LM of ``model_type`` in train mode, eager attention."""
    config, lm_cls, via = tiny_config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = lm_cls(config).train()
    PREPARE.get(model_type, lambda m: None)(model)
    return Tiny(model, via)
