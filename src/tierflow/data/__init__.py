"""Data for the LLM workflow: token files, corpora and ``tierflow tokenize``.

``TokenFile.open(path)`` memory-maps a token file (or a nanoGPT ``.bin``), ``write_tokens``
writes one atomically, ``tierflow.data.tokenize.tokenize(inputs, out)`` turns text into
train/eval token files and a tokenizer (not re-exported here: the submodule of the same name
would shadow it), ``load_tokenizer`` and ``train_tokenizer`` (``tokenizer.py``) read and
train the tokenizers it writes, and ``stdlib_corpus()`` lists the embedded default corpus. Imports no torch;
numpy and tokenizers are imported only when a name that needs them is used, so that the
command line's parser, which reads the defaults below, starts fast.
"""
from __future__ import annotations

from typing import Any

STDLIB = "stdlib"  # the INPUT name of the embedded default corpus
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_EVAL_FRACTION = 0.01

_LAZY = {"Corpus": "corpus", "collect": "corpus", "stdlib_corpus": "corpus",
         "TokenFile": "tokenfile", "TokenWriter": "tokenfile", "write_tokens": "tokenfile",
         "TokenizeResult": "tokenize", "load_tokenizer": "tokenizer",
         "train_tokenizer": "tokenizer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierflow.data' has no attribute {name!r}")


__all__ = ["STDLIB", "DEFAULT_VOCAB_SIZE", "DEFAULT_EVAL_FRACTION", *_LAZY]
