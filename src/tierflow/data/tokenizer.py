"""Tokenizers: a ``tokenizer.json`` loaded, a byte-level BPE trained, and the end-of-text token
put between documents (``tokenize.py`` writes them beside the token files; ``generate``
and ``train`` load them back).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..core.errors import TierflowError

EOT = "<|endoftext|>"
# the files beside tokenizer.json that transformers reads to load a tokenizer as it was saved
# (special tokens, chat template), and the model's generation settings (its end token)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
_EOS_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A ``tokenizers`` Tokenizer from a ``tokenizer.json`` or a directory holding one."""
    file = tokenizer_file(Path(path))
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception for any bad file
        reason = " ".join(str(err).split())[:200]
        raise TierflowError(f"--tokenizer {file} cannot be loaded ({reason}); fix: give a "
                            f"tokenizer.json saved by the Hugging Face tokenizers "
                            f"library") from None


def tokenizer_file(path: Path) -> Path:
    """The tokenizer.json that ``path`` names: itself, or the one inside a model directory."""
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TierflowError(f"--tokenizer {path} has no tokenizer.json (slow tokenizers such "
                                f"as tokenizer.model are not supported); fix: give a directory "
                                f"or file with a fast tokenizer.json")
        return file
    if not path.is_file():
        raise TierflowError(f"--tokenizer {path} does not exist; fix: give a tokenizer.json file "
                            f"or a Hugging Face model directory")
    return path


def vocab_hash(tok: Tokenizer) -> str:
    """A hash of the vocabulary, added tokens included: every (token, id) pair, so that two
    tokenizers of one size but other ids differ."""
    pairs = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


def train_tokenizer(documents: Iterable[str], vocab_size: int, n_documents: int | None = None,
                    progress: bool = False) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: any text encodes, no unknown token) trained on ``documents``.

    The end-of-text token is id 0. On a small corpus the vocab may end smaller than asked,
    when no pair is left to merge twice.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train_from_iterator(documents, trainer, length=n_documents)
    return tok


def end_of_text(tok: Tokenizer, source: str | os.PathLike[str] | None) -> tuple[str, int, bool]:
    """The token put between documents, its id, and whether it had to be added.

    A model directory's ``tokenizer_config.json`` names its ``eos_token``; otherwise the usual
    names are tried. A tokenizer with none gets ``<|endoftext|>`` added (a new id at the end).
    """
    for name in (*_config_eos(source), *_EOS_NAMES):
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return name, token_id, False
    tok.add_special_tokens([EOT])
    return EOT, tok.token_to_id(EOT), True


def _config_eos(source: str | os.PathLike[str] | None) -> list[str]:
    """The ``eos_token`` of the tokenizer_config.json beside ``source``, if there is one."""
    config = config_beside(source)
    if config is None:
        return []
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return [eos] if isinstance(eos, str) else []


def config_beside(source: str | os.PathLike[str] | None) -> Path | None:
    if source is None:
        return None
    path = Path(source)
    config = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    return config if config.is_file() else None


def has_chat_template(directory: str | os.PathLike[str]) -> bool:
    """Whether the tokenizer files of ``directory`` carry a chat template, as transformers
    finds one (``chat_template.jinja``, ``chat_template.json``, or ``chat_template`` in
    ``tokenizer_config.json``); read without transformers, so a command can refuse at once."""
    path = Path(directory)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
