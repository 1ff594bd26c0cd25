"""A preset cut into its chain on random tokens, for the benchmarks that run its stages one
by one (``profile_transients.py``, ``sampler_cost.py``, ``fresh_memory.py``)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tierflow import load_model
from tierflow.chain import Chain, to_chain
from tierflow.exec.context import AutocastMode

VOCAB = 32000


@dataclass
class ChainSample:
    """The model, its chain, the chain's input ``x`` (token ids: batch x seq) and context,
    and the autocast mode the stages run under (fp32 here: none)."""

    model: torch.nn.Module
    chain: Chain
    x: torch.Tensor
    ctx: dict[str, Any]
    autocast: AutocastMode


def random_chain(model_name: str, seq_len: int, batch: int) -> ChainSample:
    """``model_name`` (random weights from seed 0, vocabulary VOCAB) cut into its chain, on
    random token ids of ``batch`` x ``seq_len``."""
    torch.manual_seed(0)
    model = load_model(model_name, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (batch, seq_len))  # (batch, seq)
    chain = to_chain(model, {"input_ids": ids, "labels": ids})
    x, ctx = chain.split_inputs(input_ids=ids, labels=ids)
    return ChainSample(model, chain, x, ctx, AutocastMode.capture("cpu"))


def add_chain_arguments(parser: argparse.ArgumentParser, *, model: str = "llama-134m",
                        seq_len: int = 1024, batch: int = 4) -> None:
    """``--model``, ``--seq-len`` and ``--batch-size`` of the chain ``random_chain`` cuts
    (W1's by default)."""
    parser.add_argument("--model", default=model, help=f"a preset (default {model})")
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch-size", type=int, default=batch)
