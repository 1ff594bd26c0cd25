"""Token files of uniformly random ids for the benchmarks: speed and memory do not depend on
the tokens, and nothing has to be downloaded or tokenized first. Not a benchmark itself."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tierflow.data.tokenfile import write_tokens


def random_token_files(directory: Path, vocab: int, *, train_tokens: int = 1 << 20,
                       eval_tokens: int = 1 << 14, seed: int = 0) -> Path:
    """``directory``/train.bin (and eval.bin unless ``eval_tokens`` is 0) of random ids."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_tokens(directory / "train.bin",
                 rng.integers(0, vocab, train_tokens, dtype=np.uint16), vocab)
    if eval_tokens:
        write_tokens(directory / "eval.bin",
                     rng.integers(0, vocab, eval_tokens, dtype=np.uint16), vocab)
    return directory
