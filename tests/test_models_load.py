"""Presets and loading local Hugging Face checkpoints (meta device, safetensors, assign=True)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from models import tiny_configs
from tierflow import TierflowError, load_model
from tierflow.models import PRESETS, count_parameters, preset_config

TINY = tiny_configs()


def tiny_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(TINY[kind]())


def saved(tmp_path, kind: str, **kwargs):
    directory = tmp_path / kind
    tiny_model(kind).save_pretrained(directory, **kwargs)
    return directory


def logits(model, seed=1):
    """The model's logits in eval mode (no dropout) on seeded tokens."""
    model.eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=tokens).logits


# ------------------------------------------------------------------------------------ presets

PUBLISHED = {  # parameter counts of the published models (tied weights once)
    "tinyllama-1.1b": 1_100_048_384, "gpt2-124m": 124_439_808, "qwen2.5-0.5b": 494_032_768,
    "open-llama-3b": 3_426_473_600, "llama3.2-1b": 1_235_814_400, "llama3-8b": 8_030_261_248,
    "llama-20m": 19_597_568, "llama-134m": 134_105_856,
}


def test_preset_parameter_counts_match_the_published_models():
    assert set(PUBLISHED) <= set(PRESETS)
    for name, count in PUBLISHED.items():
        assert count_parameters(preset_config(name)) == count, name


def test_preset_configs_carry_the_published_numbers():
    c = preset_config("tinyllama-1.1b")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size) == (22, 2048, 5632, 32, 4, 32000)
    c = preset_config("llama3-8b")
    assert (c.num_key_value_heads, c.vocab_size, c.rope_parameters["rope_theta"]) == \
        (8, 128256, 500000.0)
    assert preset_config("llama3.2-1b").rope_parameters["rope_type"] == "llama3"
    for name, tied in {"gpt2-124m": True, "qwen2.5-0.5b": True, "llama3.2-1b": True,
                       "llama3-8b": False, "llama-134m": False}.items():
        assert preset_config(name).tie_word_embeddings is tied, name
    for name in PRESETS:
        c = preset_config(name)
        assert c._attn_implementation == "sdpa" and c.use_cache is False, name


def test_preset_vocab_and_positions_override():
    c = preset_config("llama3-8b", vocab_size=8192, max_positions=512)
    assert c.vocab_size == 8192 and c.max_position_embeddings == 512
    assert c.bos_token_id is None and c.eos_token_id is None  # out of the new vocabulary
    g = preset_config("gpt2-124m", vocab_size=4096, max_positions=256)
    assert g.vocab_size == 4096 and g.n_positions == 256
    with pytest.raises(TierflowError, match="vocab size -3"):
        preset_config("llama-20m", vocab_size=-3)


def test_unknown_preset_names_the_value_and_the_choices():
    with pytest.raises(TierflowError) as e:
        preset_config("llama-7b")
    assert all(s in str(e.value) for s in ("'llama-7b'", "llama-20m", "llama3-8b"))
    assert isinstance(e.value, ValueError)


def test_preset_random_init_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = load_model("llama-20m", vocab_size=256, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    b = load_model("llama-20m", vocab_size=256, seed=3)
    c = load_model("llama-20m", vocab_size=256, seed=4)
    assert a.config.vocab_size == 256 and a.config.num_hidden_layers == 4
    assert sum(p.numel() for p in a.parameters()) == count_parameters(a.config)
    assert torch.equal(logits(a), logits(b)) and not torch.equal(logits(a), logits(c))
    assert load_model("llama-20m", vocab_size=256, dtype=torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------- local directories

@pytest.mark.parametrize("kind", list(TINY))
def test_load_matches_from_pretrained(tmp_path, kind):
    directory = saved(tmp_path, kind)
    ours = load_model(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(logits(ours), logits(theirs))
    assert not any(t.device.type == "meta" for t in ours.state_dict().values())
    tied = ours.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied
    for (n1, b1), (n2, b2) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert n1 == n2 and torch.equal(b1, b2)  # rotary inv_freq recomputed, not left on meta


def test_loaded_weights_train(tmp_path):
    model = load_model(saved(tmp_path, "qwen2-tied"))
    tokens = torch.randint(0, 96, (2, 8))
    before = model.lm_head.weight.detach().clone()
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(before, model.get_input_embeddings().weight)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_a_model_to_train_holds_its_weights_in_its_own_memory(tmp_path):
    """Loaded to train, no weight stays a view of the mapped file: the optimizer's first
    write would copy each page anew, charged to the memory cgroup of --enforce that counted the
    file's pages already (a saved Qwen2 was killed at its smallest budget). Generation, which
    never writes them, keeps the mapping."""
    directory = saved(tmp_path, "llama")
    weights = str(directory / "model.safetensors")

    def mapped() -> bool:
        return weights in open("/proc/self/maps").read()

    model = load_model(directory)
    assert not mapped()
    del model
    kept = load_model(directory, for_generation=True)
    assert mapped()
    del kept


def test_sharded_checkpoint(tmp_path):
    directory = saved(tmp_path, "llama", max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(logits(load_model(directory)), logits(theirs))


def test_bf16_checkpoint_loads_in_the_requested_dtype(tmp_path):
    directory = tmp_path / "bf16"
    tiny_model("llama").to(torch.bfloat16).save_pretrained(directory)
    model = load_model(directory)
    assert model.dtype == torch.float32
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(logits(model), logits(theirs))
    assert load_model(directory, dtype=None).dtype == torch.bfloat16


def test_base_model_names_without_prefix(tmp_path):
    """GPT-2 as published names its tensors h.0... without the transformer. prefix."""
    directory = saved(tmp_path, "gpt2")
    state = load_file(directory / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in state.items()},
              directory / "model.safetensors", metadata={"format": "pt"})
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(logits(load_model(directory)), logits(theirs))


def test_checkpoint_names_the_model_already_uses_need_no_renaming_table(tmp_path,
                                                                         monkeypatch):
    """Without transformers' renaming table (transformers 4 names its modules as the
    checkpoints do), a checkpoint that uses the model's own names loads as before, and one
    that needs a renaming is refused in one line, naming the tensors."""
    import sys
    directory = saved(tmp_path, "gpt-neox")
    expected = logits(load_model(directory))
    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # ImportError
    with pytest.raises(TierflowError, match=r"lm_head.weight.*unexpected \(embed_out.weight\)"):
        load_model(directory)
    state = load_file(directory / "model.safetensors")
    state["lm_head.weight"] = state.pop("embed_out.weight")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(logits(load_model(directory)), expected)


def test_vocab_larger_than_the_model_is_refused(tmp_path):
    with pytest.raises(TierflowError, match="larger than the model's"):
        load_model(saved(tmp_path, "llama"), vocab_size=1000)


# ------------------------------------------------------------------------------------ errors

def one_line_error(spec, match):
    with pytest.raises(TierflowError, match=match) as e:
        load_model(spec)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_directory(tmp_path):
    msg = one_line_error(tmp_path / "nope", "neither a preset")
    assert str(tmp_path / "nope") in msg and "llama-20m" in msg
    one_line_error(saved(tmp_path, "llama") / "config.json", "is a file")


def test_no_config_and_no_weights(tmp_path):
    directory = saved(tmp_path, "llama")
    (directory / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    assert str(directory) in one_line_error(directory, "no weights in")
    (directory / "pytorch_model.bin").write_bytes(b"pickle")
    one_line_error(directory, "pickle weights")
    (directory / "config.json").unlink()
    one_line_error(directory, "no config.json")


def test_corrupt_header_and_truncated_file(tmp_path):
    directory = saved(tmp_path, "llama")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert str(weights) in one_line_error(directory, "not a readable safetensors file")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    one_line_error(directory, "corrupt or truncated")


def test_missing_unexpected_and_mismatched_tensors(tmp_path):
    directory = saved(tmp_path, "llama")
    weights = directory / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if "layers.1.mlp" not in k}, weights)
    one_line_error(directory, r"3 tensors missing \(model.layers.1.mlp")
    save_file({**state, "model.extra.weight": torch.zeros(2)}, weights)
    one_line_error(directory, r"unexpected \(model.extra.weight\)")
    save_file({**state, "model.norm.weight": torch.ones(31)}, weights)
    one_line_error(directory, r"model.norm.weight .* shape \[31\] but config.json needs \[32\]")


def test_sharded_index_naming_a_missing_shard(tmp_path):
    directory = saved(tmp_path, "llama", max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    victim = sorted(directory.glob("model-*-of-*.safetensors"))[0]
    victim.unlink()
    one_line_error(directory, f"names shard {victim.name}")


def test_config_json_states_the_vocab_and_positions_the_loaded_config_has(tmp_path):
    """What the command line checks before torch is imported is what the loaded model's
    config holds: Llama's max_position_embeddings, GPT-2's n_positions."""
    from transformers import GPT2Config, LlamaConfig

    from tierflow.models.files import read_config_json, vocab_and_positions
    for name, config in (("llama", LlamaConfig(vocab_size=300, max_position_embeddings=77)),
                         ("gpt2", GPT2Config(vocab_size=301, n_positions=78))):
        config.save_pretrained(tmp_path / name)
        assert vocab_and_positions(read_config_json(tmp_path / name)) == \
            (config.vocab_size, config.max_position_embeddings)  # GPT-2 maps it to n_positions
        assert config.max_position_embeddings in (77, 78)
    assert vocab_and_positions({"model_type": "llama"}) == (None, None)  # left at the defaults


def test_a_random_build_holds_nothing_once_its_parameters_are_replaced():
    """The build keeps no reference to the parameters it allocated: once the model's own are
    replaced (the bf16 cast does this), the first ones are freed at once, with no garbage
    collection. A reference cycle in the build had kept a float32 copy of the 8B model
    (30 GiB) in host RAM beside its bf16 weights until the next collection."""
    import gc
    import weakref

    gc.disable()
    try:
        model = load_model("llama-20m", dtype=torch.float32, seed=0)
        first = [weakref.ref(p) for p in model.parameters()]
        for module in model.modules():  # new Parameter objects, as apply_precision makes
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.detach().clone())
        assert all(ref() is None for ref in first)
    finally:
        gc.enable()
