"""The training and evaluation batches of ``tierflow train``, drawn from the token files of
its data directory (``data_dir.py`` opens and checks it).

``Batches`` draws random windows of ``seq_len + 1`` tokens from ``train.bin``. Batch ``k``
comes from a numpy generator seeded with ``(seed, k)``, so the whole stream position is one
integer (``index``), saved in checkpoints and restored on resume: batch ``k`` is the same in
every run with the same seed. With ``N`` ranks (torchrun), rank ``r`` draws the same global
batch and reads only its ``batch_size / N`` rows (``part=(r, N)``), so the ranks together see
exactly what one process sees. ``eval_batches`` are fixed, consecutive windows of ``eval.bin``.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.errors import TierflowError
from ..data.tokenfile import TokenFile


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
        return torch.from_numpy(self.tokens.windows(starts[self.rows].tolist(), self.seq_len + 1))

    def state(self) -> dict:
        return {"index": self.index, "seed": self.seed}


def eval_batches(tokens: TokenFile, seq_len: int, batch_size: int, steps: int, *,
                 whole: bool = False) -> list[torch.Tensor]:
    """Up to ``steps`` batches of consecutive, non-overlapping windows from the start of
    ``tokens`` (fewer when the file is short; none when it holds less than one window). The
    windows left after the last full batch make a smaller batch when there is no full one,
    or with ``whole`` (``tierflow eval``: every window of the file)."""
    n_windows = (len(tokens) - 1) // seq_len
    out = []
    w = 0
    while len(out) < steps and w + batch_size <= n_windows:
        starts = [(w + i) * seq_len for i in range(batch_size)]
        out.append(torch.from_numpy(tokens.windows(starts, seq_len + 1)))
        w += batch_size
    if w < n_windows and len(out) < steps and (whole or not out):
        starts = [i * seq_len for i in range(w, n_windows)]
        out.append(torch.from_numpy(tokens.windows(starts, seq_len + 1)))
    return out
