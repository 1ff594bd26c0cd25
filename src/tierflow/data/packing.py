"""Which documents of a token file share a packed row (numpy only: the command line checks
that every document fits ``--seq-len`` before it imports torch; ``train/packing.py`` builds
the rows' tensors)."""
from __future__ import annotations

import numpy as np

from ..core.errors import TierflowError
from .tokenfile import TokenFile


def document_lengths(tokens: TokenFile) -> np.ndarray:
    """(documents,) int64 token counts of a file with boundaries."""
    return np.diff(np.asarray(tokens.offsets, dtype=np.int64))


def check_fits(tokens: TokenFile, seq_len: int) -> None:
    """One line when a document of ``tokens`` is longer than a packed row of ``seq_len``."""
    _check_lengths(document_lengths(tokens), seq_len, str(tokens.path))


def _check_lengths(lengths: np.ndarray, seq_len: int, where: str) -> None:
    if len(lengths) and int(lengths.max()) > seq_len:
        doc = int(np.argmax(lengths))
        raise TierflowError(f"{where}: document {doc} is {int(lengths[doc]):,} tokens, more "
                            f"than --seq-len {seq_len} (a packed row holds whole documents); "
                            f"fix: raise --seq-len, or tokenize again with --seq-len "
                            f"{seq_len} --truncate")


def pack_rows(lengths: np.ndarray, seq_len: int, where: str) -> list[list[int]]:
    """The documents (by index) of each row: in order, a new row when the next document does
    not fit the current one (``seq_len`` tokens a row). ``where`` names the file in errors."""
    _check_lengths(lengths, seq_len, where)
    rows: list[list[int]] = []
    free = 0
    for doc, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        if rows and length <= free:
            rows[-1].append(doc)
            free -= length
        else:
            rows.append([doc])
            free = seq_len - length
    return rows
