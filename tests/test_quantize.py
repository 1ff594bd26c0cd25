"""Int8 weights for generation: the rounding, the fused and unfused products, ``tierflow
quantize`` on Llama (``nn.Linear``) and GPT-2 (``Conv1D``, tied head), streaming a quantized
checkpoint under ``--ram``, and the errors."""
from __future__ import annotations

import io
import json

import pytest
import torch
from cli_support import assert_error_line, run_main
from models import CORE_FAMILIES, tiny_hf
from test_generate_stream import LAYERS, PROMPT, save_tiny, smallest_budget

from tierflow import load_model
from tierflow.core.errors import TierflowError
from tierflow.data.tokenizer import train_tokenizer
from tierflow.generate.memory import memory_needed
from tierflow.generate.options import GenerateRequest
from tierflow.generate.sample import run
from tierflow.models.int8 import Int8Linear, quantize_int8, quantize_weight

TEXTS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog. " * 4,
         "import os\nprint(os.getcwd())\n"] * 3


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 300)


@pytest.fixture(autouse=True)
def no_page_cache_allowance(monkeypatch):
    """As in test_generate_stream: a tiny checkpoint is smaller than the read-ahead."""
    monkeypatch.setattr("tierflow.generate.stream.PAGE_CACHE_BYTES", 0)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def dirs(request, tmp_path_factory, tok):
    """(the fp32 checkpoint, its int8 copy written by ``tierflow quantize``)."""
    root = tmp_path_factory.mktemp(request.param)
    save_tiny(root / "model", request.param, tok)
    from tierflow.generate.quantize import quantize_checkpoint
    quantize_checkpoint(root / "model", root / "int8", log=io.StringIO())
    return root / "model", root / "int8"


def test_each_weight_is_within_half_its_rows_scale():
    weight = torch.randn(48, 64) * torch.linspace(0.01, 3, 48)[:, None]
    weight[5] = 0  # an all-zero row
    q, scales = quantize_weight(weight)
    assert q.dtype == torch.int8 and scales.shape == (48,) and scales[5] == 0
    assert q.abs().max() == 127  # each nonzero row uses the whole range
    error = (q.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert (q[5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [64, 48])  # 48: not a whole block, never fused
def test_the_int8_product_is_the_dequantized_product(dtype, in_features):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 40).to(dtype)
    reference = torch.nn.Linear(in_features, 40).to(dtype)
    reference.load_state_dict(linear.state_dict())
    model = torch.nn.Sequential(linear)
    assert quantize_int8(model) == ["0"]
    layer = model[0]
    assert isinstance(layer, Int8Linear) and layer.weight.dtype == torch.int8
    reference.weight.data = layer.weight.float().mul(layer.scales.float()[:, None]).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    prefill = torch.randn(2, 40, in_features, dtype=dtype)  # (batch, seq, in): the matmul
    decode = prefill[:, -1:]  # a view off the 64-byte boundary, as the last position
    one = prefill[0, -1:]  # (1, in): one token
    paths = [layer.fused(x) for x in (prefill, decode, one)]
    assert paths == ([False, True, True] if in_features == 64 else [False] * 3)
    for x in (prefill, decode, one):
        torch.testing.assert_close(layer(x), reference(x), **tol)
    storage = torch.empty(layer.weight.numel() + 8, dtype=torch.int8)  # a misaligned weight
    layer.weight.data = storage[8:].view_as(layer.weight).copy_(layer.weight)
    assert not layer.fused(one)
    torch.testing.assert_close(layer(one), reference(one), **tol)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits in eval mode (no dropout)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_a_quantized_checkpoint_is_the_quantized_model(dirs):
    """What generate loads from the written copy is exactly the original model quantized in
    memory, and close to the original (a relative error of about 1% per product)."""
    original, int8 = dirs
    loaded = load_model(int8, dtype=torch.float32, for_generation=True)
    in_memory = load_model(original, dtype=torch.float32)
    reference = logits(in_memory, ids := torch.tensor([[5, 17, 42, 7, 99, 3]]))
    replaced = quantize_int8(in_memory)
    assert len(replaced) == (7 * LAYERS + 1 if "llama" in str(original) else 4 * LAYERS)
    tied = in_memory.get_output_embeddings().weight is in_memory.get_input_embeddings().weight
    assert tied == ("gpt2" in str(original))  # a tied head is left as it is
    torch.testing.assert_close(logits(loaded, ids), logits(in_memory, ids), rtol=0, atol=0)
    relative = (logits(loaded, ids) - reference).norm() / reference.norm()
    assert 0 < relative < 0.03, relative
    config = json.loads((int8 / "config.json").read_text())
    assert config["tierflow_quantization"]["weights"] == "int8"
    assert (int8 / "tokenizer.json").is_file()
    assert not list(int8.parent.glob(".*partial"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the scales converted as read
def test_streaming_a_quantized_checkpoint_gives_the_in_ram_text(dirs, tok, dtype, capsys):
    original, int8 = dirs
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    prompt_tokens = len(tok.encode(PROMPT).ids)
    need, need_float = (memory_needed(d, torch_dtype, prompt_tokens, 24) for d in dirs[::-1])
    assert need.weights < (0.5 if dtype == "fp32" else 0.8) * need_float.weights  # int8: 1 B
    out = io.StringIO()
    run(GenerateRequest.of(int8, PROMPT, max_new_tokens=24, temperature=0.9, seed=3,
                           dtype=dtype), out=out)
    reference = out.getvalue().rsplit("\n[generate] ", 1)[0]
    capsys.readouterr()
    smallest = smallest_budget(int8, dtype)
    smallest_original = smallest_budget(original, dtype)
    assert smallest < smallest_original
    out = io.StringIO()
    run(GenerateRequest.of(int8, PROMPT, max_new_tokens=24, temperature=0.9, seed=3,
                           dtype=dtype, ram=smallest), out=out)
    text, summary = out.getvalue().rsplit("\n[generate] ", 1)
    assert text == reference and summary.endswith(f", {dtype}, int8 weights\n")
    err = capsys.readouterr().err
    assert f"0 of {LAYERS} decoder layers stay in RAM" in err and "tierflow quantize" not in err
    run(GenerateRequest.of(original, PROMPT, max_new_tokens=2, dtype=dtype,
                           ram=smallest_original), out=io.StringIO())  # streams: with a tip on an int8 copy
    size = 4 if dtype == "fp32" else 2  # the checkpoint is fp32
    assert (f"[stream] an int8 copy of this checkpoint (tierflow quantize; the text differs "
            f"slightly) holds and reads 1 byte per linear weight, where this run holds {size} "
            "and reads 4") in capsys.readouterr().err
    for directory, hint in ((original, True), (int8, False)):  # below even streaming
        with pytest.raises(TierflowError, match="give --ram") as refused:
            run(GenerateRequest.of(directory, PROMPT, max_new_tokens=24, dtype=dtype,
                                   ram=1000), out=io.StringIO())
        assert ("an int8 copy (tierflow quantize" in str(refused.value)) == hint


def test_quantize_refuses_what_it_cannot_do(dirs, tmp_path, capsys):
    original, int8 = dirs
    code, _, err = run_main("quantize", "--model", str(original), "--out", str(int8),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, [f"--out {int8} already exists", "give a new directory"])
    code, _, err = run_main("quantize", "--model", str(int8), "--out", str(tmp_path / "again"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, ["already quantized", "the checkpoint it was made from"])
    code, _, err = run_main("quantize", "--model", str(original), "--out",
                            str(tmp_path / "no" / "such"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["is not a writable directory"])
    with pytest.raises(TierflowError, match="only tierflow generate reads"):
        load_model(int8)  # what training and evaluation load


def test_an_unknown_quantization_is_one_line(dirs, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(dirs[1], copy)
    config = json.loads((copy / "config.json").read_text())
    config["tierflow_quantization"] = {"weights": "int3"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(TierflowError, match="does not know"):
        load_model(copy, for_generation=True)


def test_a_failed_write_leaves_nothing_behind(dirs, tmp_path, monkeypatch, capsys):
    from tierflow.train import checkpoint

    def full(f, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "_write", full)
    out = tmp_path / "int8"
    with pytest.raises(TierflowError, match="No space left on device.*nothing was left"):
        from tierflow.generate.quantize import quantize_checkpoint
        quantize_checkpoint(dirs[0], out, log=io.StringIO())
    assert list(tmp_path.iterdir()) == []


def test_fit_refuses_an_int8_model():
    import tierflow
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    tierflow.quantize_int8(model)
    with pytest.raises(TierflowError, match="model's 0 is an int8 layer.*before quantizing"):
        tierflow.fit(model, torch.randn(8, 32), ram="1GiB")


def test_a_sharded_checkpoint_is_quantized_into_one_file(tok, tmp_path):
    import transformers

    from tierflow.generate.quantize import quantize_checkpoint
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model",
                                                          max_shard_size="40KB")
    assert len(list((tmp_path / "model").glob("model-*.safetensors"))) > 1
    quantize_checkpoint(tmp_path / "model", tmp_path / "int8", log=io.StringIO())
    assert [p.name for p in (tmp_path / "int8").glob("*.safetensors")] == ["model.safetensors"]
    loaded = load_model(tmp_path / "int8", for_generation=True)
    in_memory = load_model(tmp_path / "model")
    quantize_int8(in_memory)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(logits(loaded, ids), logits(in_memory, ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_every_core_family_quantizes_and_decodes(family, tmp_path):
    """Each family's checkpoint, quantized on disk, loads as the model quantized in memory,
    stays within 3% of the float logits, and decodes with its KV cache."""
    from tierflow.generate.quantize import quantize_checkpoint
    from tierflow.generate.options import Sampling
    from tierflow.generate.sample import sample_ids
    tiny_hf(family).save_pretrained(tmp_path / "model")
    quantize_checkpoint(tmp_path / "model", tmp_path / "int8", log=io.StringIO())
    loaded = load_model(tmp_path / "int8", for_generation=True)
    in_memory = load_model(tmp_path / "model")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    reference = logits(in_memory, ids)
    assert quantize_int8(in_memory)
    torch.testing.assert_close(logits(loaded, ids), logits(in_memory, ids), rtol=0, atol=0)
    relative = (logits(loaded, ids) - reference).norm() / reference.norm()
    assert 0 < relative < 0.03, relative
    decoded = list(sample_ids(loaded, ids[0].tolist(), Sampling(6, temperature=0)))
    assert len(decoded) == 6


def test_the_written_int8_weights_map_aligned(tmp_path, monkeypatch):
    """The copy's data starts on a 64-byte boundary, so where every tensor's size is a
    multiple of 64 bytes (as in the usual LLM shapes) its int8 weights are memory-mapped
    aligned for the fused kernel, and loading copies none of them."""
    import transformers
    from safetensors import safe_open

    from tierflow.generate.quantize import quantize_checkpoint
    from tierflow.models.safetensors_io import read_header
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    quantize_checkpoint(tmp_path / "model", tmp_path / "int8", log=io.StringIO())
    stored = read_header(tmp_path / "int8" / "model.safetensors")
    assert all(t.nbytes % 64 == 0 for t in stored.values())
    int8 = [name for name, t in stored.items() if t.dtype == torch.int8]
    with safe_open(str(tmp_path / "int8" / "model.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(name).data_ptr() % 64 == 0 for name in int8)
    clone, copied = torch.Tensor.clone, []

    def counted(t, *args, **kwargs):
        copied.append(t.dtype)
        return clone(t, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "clone", counted)
    loaded = load_model(tmp_path / "int8", for_generation=True)
    assert torch.int8 not in copied and len(int8) == 15
    assert all(loaded.get_parameter(name).data_ptr() % 64 == 0 for name in int8)
