"""Every model type of transformers' causal-LM mapping: trained exactly by tierflow, or refused
by name before any step (registry.py says how a family is checked, registry_configs.py how
its tiny model is built).

The tables below are what docs/models.md shows (benchmarks/models_table.py): a family that
starts or stops training exactly fails its test until they say so.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from registry import Outcome, check, record
from registry_configs import VOCAB, tiny_model
from tierflow.cli import main as cli
from tierflow.data.tokenfile import write_tokens

FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

# Families tierflow refuses, with a fragment of the reason the refusal gives.
REFUSED = {
    "big_bird": "replaces some of its own modules as it runs",
    "blt": "in training mode the chained loss",  # its local encoder's patches
    "git": "its own loss fails on one sequence",  # its text loss needs image tokens
    "hrm_text": "does not call a list of decoder layers once each",  # recurrent cycles
    "inkling2_text": "the chained loss's gradient differs",  # block states between layers
    "musicgen": "its own forward fails on one sequence",  # codebooks interleaved in the batch
    "musicgen_melody": "its own forward fails on one sequence",
    # trains on whole axial-position blocks only, its reversible layers inside one Function
    "reformer": "its own loss fails on one sequence",
    "xlm": "draws random numbers between decoder layers",
    "zaya": "that the layers before it compute",  # router states passed layer to layer
}

# transformers 5.23.0 cannot build these on their own: drafters for speculative decoding
# whose every layer reads the key-value cache of the model they draft for.
UNBUILDABLE = {
    "gemma4_assistant": "layer types producing a cache",
    "gemma4_unified_assistant": "layer types producing a cache",
}

# Not decoder-only causal LMs, left out of the 95% bound (they are checked all the same).
ENCODERS = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
            "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
            "roformer", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod")
ENCODER_DECODER_DECODERS = ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small",
                            "marian", "mbart", "musicgen", "musicgen_melody", "mvp", "pegasus",
                            "plbart", "prophetnet", "trocr", "whisper")
NOT_DECODER_ONLY = {
    **{t: "a bidirectional encoder with a causal-LM option" for t in ENCODERS},
    **{t: "the decoder of an encoder-decoder model" for t in ENCODER_DECODER_DECODERS},
    "git": "an image-to-text model: its text loss needs the image",
    **{t: "a drafter for another model's cache" for t in UNBUILDABLE},
}

# The named families: each must train exactly.
MUST_BE_EXACT = ("gemma2", "gemma3", "llama4", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss",
                 "qwen3_next")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run many small kernels: one thread is several times faster than two
    that wait on each other (and on whatever else shares the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_trains_exactly_or_is_refused_by_name(model_type):
    if model_type in UNBUILDABLE:
        with pytest.raises(ValueError, match=UNBUILDABLE[model_type]):
            tiny_model(model_type)
        record(Outcome(model_type, "", False, "", "transformers cannot build it on its own "
                       "(a drafter reading its target model's cache)", "", 0.0))
        return
    outcome = check(model_type)
    record(outcome)
    if model_type in REFUSED:
        assert not outcome.exact, f"{model_type} now trains exactly: take it out of REFUSED"
        assert REFUSED[model_type] in outcome.reason, outcome.message
        assert outcome.message.startswith(f"model type '{outcome.via or model_type}' (")
        assert "\n" not in outcome.message
    else:
        assert outcome.exact, outcome.message


def test_decoder_only_families_train_exactly():
    """At least 95% of the decoder-only families train exactly, the named ones among them."""
    for table in (REFUSED, UNBUILDABLE, NOT_DECODER_ONLY):
        assert set(table) <= set(FAMILIES), sorted(set(table) - set(FAMILIES))
    assert set(MUST_BE_EXACT) <= set(FAMILIES) - set(REFUSED)
    decoder_only = [t for t in FAMILIES if t not in NOT_DECODER_ONLY]
    refused = [t for t in decoder_only if t in REFUSED]
    assert len(refused) <= 0.05 * len(decoder_only), refused


def test_train_refuses_a_family_in_one_line_with_exit_code_2(tmp_path):
    """``tierflow train`` on a refused family: the refusal as ``tierflow: error: ...``, exit
    code 2, before any step."""
    tiny_model("zaya").model.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    write_tokens(tmp_path / "data" / "train.bin",
                 np.random.default_rng(0).integers(3, VOCAB, 2000), VOCAB)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"),
                  "--seq-len", "16", "--batch-size", "2", "--dtype", "fp32", "--eval-every", "0",
                  "--steps", "2", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    line = "tierflow: error: model type 'zaya' (ZayaForCausalLM) cannot be trained exactly by " \
           "tierflow: its decoder layer 1 takes an input"
    assert err.getvalue().startswith(line) and err.getvalue().count("\n") == 1
    assert "[T] step" not in out.getvalue()
