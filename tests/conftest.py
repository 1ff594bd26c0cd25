"""Test setup: the tiny models in tests/models.py, one intra-op thread (the test models are
far too small to gain from more, and a busy 2-core machine makes OpenMP thrash), and a
tierflow cache of the test session's own (the user's ~/.cache is never written)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def train_env(tmp_path_factory):
    """A tiny tokenized corpus and a tiny Llama saved with save_pretrained (one per test
    module): see ``cli_support.make_train_env``."""
    from cli_support import make_train_env
    return make_train_env(tmp_path_factory.mktemp("train"))
