"""What `fit` itself allocates while it plans stays inside the budget: the LM head is not
profiled in chunks whose profile alone would pass it, and chaining a model on the disk tier
holds one large weight at a time. What the caller held before `fit` it cannot undo: a model
in RAM above the budget is named in the plan's notes."""
from __future__ import annotations

import os

import pytest
import torch
from fresh_process import run_in_fresh_process
from models import VOCAB, hf_sample, tiny_hf
from torch import nn

import tierflow
from tierflow.chain import to_chain
from tierflow.core.config import FitConfig
from tierflow.exec.offload import offloaded_parameters
from tierflow.plan.tier_search import LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK, auto_head_chunk
from tierflow.profile.head_chunk import HEAD_TRANSIENT, head_profile_bytes


def test_the_head_profile_is_priced_from_the_shapes():
    model = tiny_hf("llama")
    sample = hf_sample(batch=2, seq=16)
    head = model.get_output_embeddings().weight.nbytes
    most = max(nograd for _, nograd in HEAD_TRANSIENT.values())
    assert head_profile_bytes(model, sample, 1024) == head + int(most * 32 * VOCAB * 4)
    assert head_profile_bytes(model, sample, 8) == head + int(most * 8 * VOCAB * 4)
    assert head_profile_bytes(nn.Sequential(nn.Linear(4, 4)), sample, 1024) is None
    assert head_profile_bytes(model, torch.zeros(2, 16, dtype=torch.long), 1024) is None


def test_without_the_large_chunk_only_the_small_one_is_planned():
    tried = []

    def attempt(tokens):
        tried.append(tokens)
        return tokens

    assert auto_head_chunk(attempt, lambda planned: planned, try_large=False) == \
        SMALL_HEAD_CHUNK
    assert tried == [SMALL_HEAD_CHUNK]


def test_fit_skips_a_head_chunk_whose_profile_would_pass_the_budget(monkeypatch):
    """Priced above the budget, the 1024-token chunk is neither chained nor profiled; the
    plan runs 256-token chunks and fit says why."""
    import tierflow.fitting.profile_step as api

    chunks = []
    original = api.to_chain

    def chained(model, sample, *, head_chunk_tokens):
        chunks.append(head_chunk_tokens)
        return original(model, sample, head_chunk_tokens=head_chunk_tokens)

    budget = 1 << 30
    monkeypatch.setattr(api, "to_chain", chained)
    monkeypatch.setattr(api, "head_profile_bytes",
                        lambda model, sample, tokens: budget + 1 if tokens == LARGE_HEAD_CHUNK
                        else 0)
    module = tierflow.fit(tiny_hf("llama"), hf_sample(), ram=budget)
    assert chunks == [SMALL_HEAD_CHUNK]
    assert module.chain.stages[-1].chunk_tokens == SMALL_HEAD_CHUNK
    assert any(f"profiling chunks of {LARGE_HEAD_CHUNK} would take" in line
               for line in module.fit_log)
    monkeypatch.setattr(api, "head_profile_bytes", lambda model, sample, tokens: budget // 2)
    chunks.clear()
    tierflow.fit(tiny_hf("llama"), hf_sample(), ram=budget)  # inside the budget: tried first
    assert chunks[0] == LARGE_HEAD_CHUNK


def test_the_head_profile_counts_what_is_in_use_beside_it(monkeypatch):
    """Weights held in memory (a model in RAM) and what fit allocated so far come first."""
    import tierflow.fitting.profile_step as api

    said = []
    monkeypatch.setattr(api, "head_profile_bytes", lambda model, sample, tokens: 300)
    fits = lambda in_use: api.large_head_chunk_fits(  # noqa: E731
        None, None, 1000, in_use, said.append)
    assert fits(700) and not said
    assert not fits(701)
    assert said == [f"the LM head runs in chunks of {SMALL_HEAD_CHUNK} tokens: profiling "
                    f"chunks of {LARGE_HEAD_CHUNK} would take about 300 B beside the 701 B in "
                    "use, above the budget"]
    assert api.large_head_chunk_fits(None, None, None, 10 ** 12, said.append)  # no budget


def test_chaining_a_model_on_disk_holds_one_large_weight_at_a_time(tmp_path):
    """The chain's verification fetches the head while nothing else is held: the embedding
    that a run with gradients on keeps fetched comes after it (it took both at once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(  # embedding and head 512 KiB each, a layer 37 KiB
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "model")
    model = tierflow.load_model(tmp_path / "model", disk=tmp_path)
    offloaded = offloaded_parameters(model)
    embed = model.get_input_embeddings().weight.nbytes
    head = model.get_output_embeddings().weight.nbytes
    layer = sum(p.nbytes for p in model.model.layers[0].parameters())
    with offloaded.on_demand(model):
        to_chain(model, hf_sample(), head_chunk_tokens=SMALL_HEAD_CHUNK)
    assert offloaded.peak_resident_bytes < embed + head
    assert offloaded.peak_resident_bytes <= max(embed, head) + layer


def test_a_model_that_came_in_ram_above_the_budget_is_named(tmp_path):
    """136 MiB of weights in RAM, every one frozen but the final norm, under ram="120MiB"
    with a disk tier: the plan streams them from there and its notes say that the process
    held them all before fit moved them, and how to build the model on disk instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=24,
        num_attention_heads=4, num_key_value_heads=4))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("model.norm."))
    ids = torch.randint(0, 32000, (1, 32))
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    module = tierflow.fit(model, {"input_ids": ids, "labels": ids}, ram="120MiB",
                          disk=tmp_path, optimizer=adamw)
    assert any(note.startswith("the model came in RAM with 136.05 MiB of weights, above the "
                               "budget of 120.00 MiB") and "tierflow.load_model" in note
               for note in module.plan.notes), module.plan.notes
    small = tierflow.fit(tiny_hf("llama"), hf_sample(), ram="1GiB", disk=tmp_path,
                         optimizer=adamw)
    assert not any("came in RAM" in note for note in small.plan.notes)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_fit_itself_stays_inside_a_feasible_budget(tmp_path):
    """A Llama with a 32000-token vocabulary loaded onto the disk tier, its last layer
    trainable, seq 512 x 2: fit's whole peak (chaining, every profile, the optimizer probe)
    stays under ram="160MiB", a budget its plan fits. Profiling 1024-token head chunks
    first passed it (in a fresh process: profiles are cached per process)."""
    run_in_fresh_process("test_fit_profile_budget", "_fit_peak_inside_the_budget",
                         str(tmp_path))


def _fit_peak_inside_the_budget(directory: str) -> None:
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from tierflow.exec.memory import return_free_memory
    from tierflow.profile.machine import maxrss_bytes, reset_peak_rss

    root = Path(directory)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4)).save_pretrained(root / "model")
    model = tierflow.load_model(root / "model", disk=root)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("model.layers.3.", "model.norm.")))
    ids = torch.randint(0, 32000, (2, 512))
    budget = 160 << 20
    return_free_memory()
    reset_peak_rss()
    base = maxrss_bytes()  # no weight in memory: each waits on the disk tier
    # one timed round a stage (after its memory round and warm-up): more rounds repeat the
    # same work and hold no more
    module = tierflow.fit(model, {"input_ids": ids, "labels": ids}, ram=budget, disk=root,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          config=FitConfig(profile_repeats=1, profile_seconds=0.0))
    peak = maxrss_bytes() - base
    assert peak <= budget, (peak / 2 ** 20, module.plan.notes)
    assert module.chain.stages[-1].chunk_tokens == SMALL_HEAD_CHUNK
