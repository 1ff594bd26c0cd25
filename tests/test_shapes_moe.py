"""sim/shapes.py beyond dense Llamas: mixtures of experts and latent attention, counted from a
config.json against transformers' own models on the meta device and against the published
totals; a plan's FLOPs count the parameters a token uses, not all of them; and
``tierflow plan --model DIR`` works from the config.json of every family the registry test
trains exactly."""
from __future__ import annotations

import json

import pytest
from cli_support import run_main

from registry_configs import tiny_config
from test_registry import ENCODER_DECODER_DECODERS, FAMILIES, REFUSED, UNBUILDABLE
from tierflow.models.presets import count_parameters, meta_model
from tierflow.sim.shapes import load_shape, shape_from_config
from tierflow.sim.stages import StepShape, step_flops

# Published config.json files (Hugging Face hub, Qwen/Qwen3-30B-A3B and
# deepseek-ai/DeepSeek-V3), the fields a shape reads.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "tie_word_embeddings": False, "attention_bias": False}
# (total, active) parameters as published: 30.5B / 3.3B; 671B / 37B (the main model; the
# multi-token-prediction module, which transformers does not build, is not counted)
PUBLISHED = {"qwen3-30b-a3b": (QWEN3_30B_A3B, 30.5e9, 3.3e9),
             "deepseek-v3": (DEEPSEEK_V3, 671e9, 37e9)}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_counts_match_the_meta_model(family):
    """Total parameters (exact but for per-layer rounding where dense and MoE layers mix,
    and the 1e-3 of norms and biases a family adds), and the active ones: the total less
    the routed experts a token does not use."""
    config, _, _ = tiny_config(family)
    model = meta_model(config)
    total = count_parameters(config, model)
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    shape = shape_from_config(config.to_dict(), family)
    assert shape.experts and routed
    assert shape.total_params() == pytest.approx(total, rel=1e-3, abs=shape.layers)
    idle = routed * (shape.experts - shape.experts_per_token) / shape.experts
    assert shape.active_params() == pytest.approx(total - idle, rel=1e-3, abs=shape.layers)


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_flops_count_active_parameters(name, tmp_path):
    """The FLOPs per token a plan prices (``sim/stages.step_flops``, which ``sim/predict``
    divides into tok/s) count the parameters a token uses. (The command line end to end:
    the per-family test below; a plan of the whole 671B model takes a minute to search.)"""
    config, total, active = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_shape(str(tmp_path))
    assert shape.total_params() == pytest.approx(total, rel=0.01)
    assert shape.active_params() == pytest.approx(active, rel=0.03)
    step = StepShape(seq=4096, batch=1)
    flops = step_flops(shape, step) / step.tokens
    # 6 FLOPs per used parameter and token (forward and backward), plus causal attention at
    # 4096 tokens; every parameter would be 6 x total
    assert 6 * active <= flops <= 6 * active * 1.25
    assert flops < 6 * total / 4


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED
                                    and f not in UNBUILDABLE
                                    and f not in ENCODER_DECODER_DECODERS])
def test_plan_works_from_the_config_json_of_every_trained_family(family, tmp_path, capsys):
    """Every family the registry trains exactly but the decoders of encoder-decoder models,
    whose config.json describes the whole model (the simulator refuses it)."""
    config, _, _ = tiny_config(family)
    config.to_json_file(tmp_path / "config.json")
    code, out, err = run_main("plan", "--model", str(tmp_path), "--hardware", "cpu",
                              "--seq-len", "64", "--ram", "1", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["params"] > 0
