"""Token files of uniformly random ids for the benchmarks: speed and memory do not depend on
the tokens, and nothing has to be downloaded or tokenized first. Not a benchmark itself.

Written in token-file format version 1 (a 64-byte header, then uint16 tokens: no loss mask, no
document boundaries), which every tierflow reads, so that a benchmark comparing two commits
(`against_base.py`) gives both the same files."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from tierflow.data.tokenfile import HEADER_BYTES, MAGIC

VERSION_1 = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, token count, vocab size


def random_token_files(directory: Path, vocab: int, *, train_tokens: int = 1 << 20,
                       eval_tokens: int = 1 << 14, seed: int = 0) -> Path:
    """``directory``/train.bin (and eval.bin unless ``eval_tokens`` is 0) of random ids."""
    if vocab > 1 << 16:
        raise ValueError(f"vocab {vocab}: these files hold uint16 ids, at most 65536")
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, count in (("train.bin", train_tokens), ("eval.bin", eval_tokens)):
        if count:
            tokens = rng.integers(0, vocab, count, dtype=np.uint16)
            header = VERSION_1.pack(MAGIC, 1, 2, count, vocab).ljust(HEADER_BYTES, b"\0")
            (directory / name).write_bytes(header + tokens.astype("<u2").tobytes())
    return directory
