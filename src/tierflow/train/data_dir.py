"""The data directory of ``tierflow train``: ``open_data`` checks a directory written by
``tierflow tokenize`` (cheap: the token files are memory-mapped) and finds its vocabulary size.
No torch here: the command line checks ``--data`` before it imports torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import TierflowError
from ..data.tokenfile import TokenFile


@dataclass
class DataDir:
    """A checked data directory: its token files, vocabulary and tokenizer."""
    path: Path
    train: Any  # TokenFile
    eval: Any | None
    vocab_size: int
    tokenizer_file: Path | None
    max_token: int
    vocab_hash: str | None = None  # meta.json's (tokenizer.vocab_hash), None in older data

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
    return _checked(path, train, evalf, f"--data {path}")


def open_token_file(path: str | Path) -> DataDir:
    """A token file on its own (``tierflow eval FILE``: a ``.bin`` file, or a data directory
    for its eval.bin) as a ``DataDir`` whose train and eval files are both it, with the
    tokenizer and meta.json of its directory when they are there."""
    path = Path(path)
    if path.is_dir():
        if not (path / "eval.bin").is_file():
            raise TierflowError(f"{path} has no eval.bin: give a token file (.bin) or a "
                                "directory written by 'tierflow tokenize'")
        path = path / "eval.bin"
    if not path.is_file():
        raise TierflowError(f"{path} does not exist: give a token file (.bin) or a directory "
                            "written by 'tierflow tokenize'")
    tokens = TokenFile.open(path)
    if len(tokens) == 0:
        raise TierflowError(f"{path} holds no tokens: give a token file of held-out text")
    return _checked(path.parent, tokens, tokens, str(path))


def _checked(path: Path, train: Any, evalf: Any | None, what: str) -> DataDir:
    """The ``DataDir`` of the token files ``train`` and ``evalf`` of the directory ``path``:
    its vocabulary from meta.json, else its tokenizer.json, else the files; one line when a
    token id is beyond it (``what`` names the files in that line)."""
    tokenizer_file = path / "tokenizer.json"
    tokenizer_file = tokenizer_file if tokenizer_file.is_file() else None
    vocab, vocab_hash = None, None
    meta = path / "meta.json"
    if meta.is_file():
        try:
            record = json.loads(meta.read_text())
            vocab_hash = record.get("vocab_hash") or None
            vocab = int(record["vocab_size"])
        except (ValueError, KeyError, TypeError, AttributeError):
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
        raise TierflowError(f"{what} holds token id {top}, but its vocab size is {vocab}: "
                            "the token files and tokenizer do not belong together; tokenize again")
    return DataDir(path, train, evalf, int(vocab), tokenizer_file, top, vocab_hash)
