"""``tierflow generate`` under a RAM budget below the model: the plan, the text (identical to
the all-in-RAM run with the same seed), the reads per forward pass, and the errors."""
from __future__ import annotations

import io
import re
import shutil

import pytest
import torch

from tierflow.core.errors import TierflowError
from tierflow.core.units import parse_bytes
from tierflow.data.tokenizer import EOT, train_tokenizer
from tierflow.generate.memory import RUNTIME_BYTES, MemoryNeed, memory_needed
from tierflow.generate.options import GenerateRequest
from tierflow.generate.options import Sampling
from tierflow.generate.sample import run, sample_ids
from tierflow.generate.stream import PAGE_CACHE_BYTES, PREFETCH_SLOTS, load_streamed, plan_stream

TEXTS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog. " * 4,
         "import os\nprint(os.getcwd())\n"] * 3
PROMPT = "def add"
LAYERS = 8


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 300)


def save_tiny(directory, family: str, tok) -> None:
    import transformers
    vocab, eos = tok.get_vocab_size(), tok.token_to_id(EOT)
    if family == "gpt2":  # tied head, Conv1D weights
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=LAYERS, n_head=4,
                                         n_positions=96, bos_token_id=eos, eos_token_id=eos)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
            bos_token_id=None, eos_token_id=eos, pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(directory)  # fp32
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(autouse=True)
def no_page_cache_allowance(monkeypatch):
    """The plan counts up to 32 MiB of page cache for reads (chunk and read-ahead), capped at
    the checkpoint's size. A test model's whole file is smaller than one read-ahead, so with
    that allowance streaming could never fit a budget below the model: it is left out here
    (``test_plan_...`` checks that it is counted)."""
    monkeypatch.setattr("tierflow.generate.stream.PAGE_CACHE_BYTES", 0)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory, tok):
    directory = tmp_path_factory.mktemp(request.param) / "model"
    save_tiny(directory, request.param, tok)
    return directory


def test_plan_keeps_as_many_layers_as_fit_spread_over_the_depth():
    need = MemoryNeed(weights=1050, kv_cache=7, activations=3)
    layers, other, slot = [100] * 10, 50, 100
    fixed = other + PREFETCH_SLOTS * slot + 10 + RUNTIME_BYTES + 64
    plan = plan_stream(layers, [200] * 10, other, slot, need, fixed + 400, page_cache=64)
    assert plan.resident == [1, 3, 6, 8] and plan.ram == fixed + 400
    assert plan.streamed == [0, 2, 4, 5, 7, 9] and plan.bytes_per_token == 6 * 200
    assert plan_stream(layers, layers, other, slot, need, fixed + 399,
                       page_cache=64).resident == [1, 5, 8]
    smallest = plan_stream(layers, layers, other, slot, need, fixed, page_cache=64)
    assert smallest.resident == [] and smallest.ram == fixed
    assert plan_stream(layers, layers, other, slot, need, fixed).ram == (
        fixed - 64 + PAGE_CACHE_BYTES)  # counted by default
    too_small = plan_stream(layers, layers, other, slot, need, fixed - 1, page_cache=64)
    assert too_small.resident == [] and too_small.ram > too_small.budget
    described = smallest.describe(1e9)
    assert "0 of 10 decoder layers stay in RAM (none)" in described[0]
    assert "page cache 64 B" in described[1] and "1000 B read per token" in described[2]


def generated(directory, ram, dtype: str = "fp32") -> str:
    """The prompt and the continuation ``run`` prints (the timing line left out)."""
    out = io.StringIO()
    run(GenerateRequest.of(directory, PROMPT, max_new_tokens=24, temperature=0.9, seed=3,
                           dtype=dtype, ram=ram), out=out)
    text, summary = out.getvalue().rsplit("\n[generate] ", 1)
    assert "24 tokens" in summary
    return text


def smallest_budget(directory, dtype: str) -> int:
    """The smallest budget, as the refusal of a budget below it names it."""
    with pytest.raises(TierflowError, match="streaming every decoder layer needs") as err:
        generated(directory, 1000, dtype)
    message = str(err.value)
    for part in ("give --ram", "runtime", "KV cache", "page cache", "layer buffers",
                 "every weight in RAM"):
        assert part in message
    return parse_bytes(re.search(r"give --ram (\S+ \S+|\d+ B) or more", message)
                       .group(1).replace(" ", ""))


def layer_bytes(directory, dtype: torch.dtype) -> int:
    """One decoder layer's parameter bytes in ``dtype``."""
    from tierflow import load_model
    from tierflow.chain.hf import decoder_layers
    model = load_model(directory, dtype=dtype)
    return sum(p.nbytes for p in decoder_layers(model.base_model)[1][0].parameters())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: converted from the fp32 checkpoint
def test_streamed_text_equals_the_in_ram_text(model_dir, tok, dtype, capsys):
    reference = generated(model_dir, None, dtype)
    assert capsys.readouterr().err == ""  # nothing streamed without a budget
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    prompt_tokens = len(tok.encode(PROMPT).ids)
    need = memory_needed(model_dir, torch_dtype, prompt_tokens, 24).total + RUNTIME_BYTES
    assert generated(model_dir, need, dtype) == reference
    assert capsys.readouterr().err == ""  # it fits: nothing streamed
    smallest = smallest_budget(model_dir, dtype)
    assert smallest < need
    assert generated(model_dir, smallest, dtype) == reference
    err = capsys.readouterr().err
    assert f"0 of {LAYERS} decoder layers stay in RAM (none), {LAYERS} are read" in err, err
    assert "predicted" in err and "tok/s" in err and "GB/s" in err
    tied = "gpt2" in str(model_dir)  # a tied head needs the whole embedding table
    assert ("rows are read as looked up" in err) == (not tied), err
    assert ("embedding rows read" in err) == (not tied), err
    reads = int(re.search(r"\[stream\] read (\d+) layers .* waited", err).group(1))
    assert LAYERS * 24 <= reads <= LAYERS * 24 + PREFETCH_SLOTS  # one read per forward pass
    one = smallest + layer_bytes(model_dir, torch_dtype)
    assert generated(model_dir, one, dtype) == reference
    err = capsys.readouterr().err
    assert f"1 of {LAYERS} decoder layers stay in RAM (4), 7 are read" in err, err


def load(directory, tok, prompt_tokens: int, new_tokens: int):
    """The model with the most resident layers below its need (some layers streamed)."""
    need = memory_needed(directory, torch.float32, prompt_tokens, new_tokens)
    budget = need.total + RUNTIME_BYTES - 1
    return load_streamed(directory, torch.float32, need, budget, ram_text=str(budget),
                         prompt_tokens=prompt_tokens, max_new_tokens=new_tokens,
                         vocab_size=tok.get_vocab_size(), log=io.StringIO())


def test_prefill_reads_each_streamed_layer_once(model_dir, tok):
    prompt = list(range(5, 25))  # 20 tokens: one forward pass, not 20
    model, streaming = load(model_dir, tok, len(prompt), 6)
    streamed, reads = len(streaming.layers.modules), lambda: streaming.layers.reads
    try:
        assert 0 < streamed < LAYERS
        ids = list(sample_ids(model, prompt, Sampling(6, temperature=0)))
        passes = 1 + len(ids) - 1  # the prefill, then one pass per new token but the last
        assert len(ids) == 6
        assert streamed * passes <= reads() <= streamed * passes + PREFETCH_SLOTS
    finally:
        streaming.close()
    assert torch.get_num_threads() == 1  # given back


def test_the_predicted_bandwidth_skips_the_files_first_read(model_dir, tok, monkeypatch):
    """A file's first read is slow (half speed for tinyllama-1.1b's layers): the bandwidth the
    printed prediction uses is that of the reads after it, made before generation starts."""
    import time

    from tierflow.generate import layer_stream
    pread_exact, calls = layer_stream.pread_exact, []

    def first_slow(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
        return pread_exact(*args, **kwargs)
    monkeypatch.setattr(layer_stream, "pread_exact", first_slow)
    need = memory_needed(model_dir, torch.float32, 3, 4)
    budget = need.total + RUNTIME_BYTES - 3 * (need.weights // LAYERS)  # some layers streamed
    log = io.StringIO()
    model, streaming = load_streamed(model_dir, torch.float32, need, budget, ram_text="x",
                                     prompt_tokens=3, max_new_tokens=4,
                                     vocab_size=tok.get_vocab_size(), log=log)
    try:
        layers = streaming.layers
        assert len(layers.modules) >= PREFETCH_SLOTS
        layer_bytes = sum(e.stored.nbytes for e in layers.entries[1])
        printed = float(re.search(r"read per token at ([\d.e+-]+) GB/s", log.getvalue()).group(1))
        assert printed * 1e9 > 4 * layer_bytes / 0.5  # not slowed by the first read
        assert layers.bandwidth < layers.bytes_read / 0.5  # which the overall rate counts
    finally:
        streaming.close()


def test_a_checkpoint_truncated_mid_run_is_one_clear_error(model_dir, tok, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    model, streaming = load(copy, tok, 3, 4)
    try:
        with open(copy / "model.safetensors", "r+b") as f:
            f.truncate(4096)
        with pytest.raises(TierflowError, match="truncated"):
            list(sample_ids(model, [5, 6, 7], Sampling(4, temperature=0)))
    finally:
        streaming.close()


def test_cli_streams_and_says_so(tok, tmp_path, capsys):
    from cli_support import run_main
    model_dir = tmp_path / "model"
    save_tiny(model_dir, "llama", tok)
    budget = f"{smallest_budget(model_dir, 'fp32')}B"  # bytes: a bare number is GiB
    code, out, err = run_main("generate", "--model", str(model_dir), "--prompt", PROMPT,
                              "--max-new-tokens", "8", "--dtype", "fp32", "--temperature", "0",
                              "--ram", budget, capsys=capsys)
    assert code == 0, err
    assert out.startswith(PROMPT) and "[generate] 8 tokens" in out
    lines = [line for line in err.splitlines() if line.startswith("[stream] ")]
    assert len(lines) == 6 and "read per token" in lines[3] and "waited" in lines[5], lines
    assert "an int8 copy of this checkpoint (tierflow quantize" in lines[4]
    code, out, err = run_main("generate", "--model", str(model_dir), "--prompt", PROMPT,
                              "--ram", "1000B", capsys=capsys)
    assert code == 2 and out == "" and err.startswith("tierflow: error: --ram 1000B is too small")
    assert len(err.strip().splitlines()) == 1, err


def test_the_smallest_budget_named_is_all_in_ram_when_streaming_costs_more(model_dir, tok,
                                                                            monkeypatch):
    """With the real page-cache allowance a tiny model's streaming costs more than holding
    it: the refusal then names the all-in-RAM budget, and that budget works."""
    monkeypatch.setattr("tierflow.generate.stream.PAGE_CACHE_BYTES", 32 << 20)
    need = memory_needed(model_dir, torch.float32, len(tok.encode(PROMPT).ids), 24)
    in_ram = need.total + RUNTIME_BYTES
    smallest = smallest_budget(model_dir, "fp32")  # as printed: rounded up to 0.01 MiB
    assert in_ram <= smallest < in_ram + (11 << 10)
    assert generated(model_dir, smallest).startswith(PROMPT)  # fits, all in RAM
