"""The training and evaluation batches (train/data.py): windows of the token file, the same
batch for the same (seed, index), and ranks that together read one process's batch."""
from __future__ import annotations

import numpy as np
import torch

from tierflow.data import TokenFile, write_tokens
from tierflow.train.data import Batches, eval_batches


def _token_file(tmp_path, n: int = 1000) -> tuple[TokenFile, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, 500, size=n).astype(np.uint16)
    write_tokens(tmp_path / "train.bin", tokens, 500)
    return TokenFile.open(tmp_path / "train.bin"), tokens


def _is_window(row: torch.Tensor, tokens: np.ndarray) -> bool:
    starts = np.flatnonzero(tokens[: len(tokens) - len(row) + 1] == int(row[0]))
    return any(np.array_equal(tokens[s:s + len(row)], row.numpy()) for s in starts)


def test_batches_are_windows_fixed_by_seed_and_index_and_split_over_ranks(tmp_path):
    file, tokens = _token_file(tmp_path)
    one = Batches(file, seq_len=16, batch_size=4, seed=3)
    first, second = one.next(), one.next()
    assert first.shape == (4, 17) and first.dtype == torch.int64
    assert all(_is_window(row, tokens) for row in torch.cat([first, second]))
    assert not torch.equal(first, second)
    assert torch.equal(Batches(file, 16, 4, seed=3, index=1).next(), second)  # resumable
    halves = [Batches(file, 16, 4, seed=3, part=(r, 2)).next() for r in range(2)]
    assert torch.equal(torch.cat(halves), first)


def test_eval_batches_are_consecutive_windows_from_the_start(tmp_path):
    file, tokens = _token_file(tmp_path, n=100)
    batches = eval_batches(file, seq_len=10, batch_size=3, steps=5)
    assert len(batches) == 3  # 9 windows of 10 tokens (+1) in 100 tokens: 3 batches of 3
    flat = torch.cat(batches)  # (9, 11)
    for i, row in enumerate(flat):
        assert row.tolist() == tokens[i * 10:i * 10 + 11].tolist()
