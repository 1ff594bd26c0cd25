"""The data directory of ``tierflow train`` and the training batches drawn from it.

``open_data`` checks a directory written by ``tierflow tokenize`` (cheap: the token files are
memory-mapped) and finds its vocabulary size.

``Batches`` draws random windows of ``seq_len + 1`` tokens from ``train.bin``. Batch ``k``
comes from a numpy generator seeded with ``(seed, k)``, so the whole stream position is one
integer (``index``), saved in checkpoints and restored on resume: batch ``k`` is the same in
every run with the same seed. With ``N`` ranks (torchrun), rank ``r`` draws the same global
batch and reads only its ``batch_size / N`` rows (``part=(r, N)``), so the ranks together see
exactly what one process sees. ``eval_batches`` are fixed, consecutive windows of ``eval.bin``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.tokenfile import TokenFile
from ..errors import TierflowError


@dataclass
class DataDir:
    """A checked data directory: its token files, vocabulary and tokenizer."""
    path: Path
    train: Any  # TokenFile
    eval: Any | None
    vocab_size: int
    tokenizer_file: Path | None
    max_token: int

    def identity(self) -> dict[str, Any]:
        tok = None
        if self.tokenizer_file is not None:
            import hashlib
            tok = hashlib.sha256(self.tokenizer_file.read_bytes()).hexdigest()[:16]
        return {"train_tokens": len(self.train), "eval_tokens": len(self.eval) if self.eval else 0,
                "vocab_size": self.vocab_size, "tokenizer": tok}


def open_data(path: str | Path) -> DataDir:
    """Open and check ``--data path``; every problem is one ``TierflowError`` line."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise TierflowError(f"--data {path} {what}: give a directory written by 'tierflow "
                            "tokenize' (train.bin, eval.bin, tokenizer.json)")
    if not (path / "train.bin").is_file():
        raise TierflowError(f"--data {path} has no train.bin: run 'tierflow tokenize INPUT... "
                            f"--out {path}' first")
    train = TokenFile.open(path / "train.bin")
    if len(train) == 0:
        raise TierflowError(f"{path / 'train.bin'} holds no tokens: tokenize a non-empty corpus")
    evalf = TokenFile.open(path / "eval.bin") if (path / "eval.bin").is_file() else None
    tokenizer_file = path / "tokenizer.json"
    tokenizer_file = tokenizer_file if tokenizer_file.is_file() else None
    vocab = None
    meta = path / "meta.json"
    if meta.is_file():
        try:
            vocab = int(json.loads(meta.read_text())["vocab_size"])
        except (ValueError, KeyError, TypeError):
            vocab = None
    if vocab is None and tokenizer_file is not None:
        try:
            from tokenizers import Tokenizer
            vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
        except Exception:
            vocab = None
    if vocab is None:
        vocab = train.vocab_size
    top = max(train.max_token() or 0, (evalf.max_token() or 0) if evalf is not None else 0)
    if vocab is None:
        vocab = top + 1
    if top >= vocab:
        raise TierflowError(f"--data {path} holds token id {top}, but its vocab size is {vocab}: "
                            "the token files and tokenizer do not belong together; tokenize again")
    return DataDir(path, train, evalf, int(vocab), tokenizer_file, top)


class Batches:
    def __init__(self, tokens: TokenFile, seq_len: int, batch_size: int, seed: int,
                 index: int = 0, part: tuple[int, int] = (0, 1)):
        if len(tokens) < seq_len + 1:
            raise TierflowError(f"{tokens.path} holds {len(tokens)} tokens, fewer than one "
                                f"window of --seq-len {seq_len} + 1; fix: use a smaller "
                                f"--seq-len or more text")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.index = index  # batches drawn so far
        rank, ranks = part
        self.rows = slice(rank * batch_size // ranks, (rank + 1) * batch_size // ranks)

    def next(self) -> torch.Tensor:
        """This rank's rows of the next global batch: a (batch_size / ranks, seq_len + 1)
        int64 tensor."""
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        high = len(self.tokens) - self.seq_len - 1
        starts = rng.integers(0, high + 1, size=self.batch_size)  # (batch_size,)
        rows = [self.tokens.window(int(s), self.seq_len + 1) for s in starts[self.rows]]
        return torch.from_numpy(np.stack(rows))

    def state(self) -> dict:
        return {"index": self.index, "seed": self.seed}


def eval_batches(tokens: TokenFile, seq_len: int, batch_size: int, steps: int) -> list[torch.Tensor]:
    """Up to ``steps`` batches of consecutive, non-overlapping windows from the start of
    ``tokens`` (fewer when the file is short; none when it holds less than one window)."""
    n_windows = (len(tokens) - 1) // seq_len
    out = []
    w = 0
    while len(out) < steps and w + batch_size <= n_windows:
        rows = [tokens.window((w + i) * seq_len, seq_len + 1) for i in range(batch_size)]
        out.append(torch.from_numpy(np.stack(rows)))
        w += batch_size
    if not out and n_windows > 0:
        rows = [tokens.window(i * seq_len, seq_len + 1) for i in range(n_windows)]
        out.append(torch.from_numpy(np.stack(rows)))
    return out
