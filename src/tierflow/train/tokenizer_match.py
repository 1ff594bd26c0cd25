"""The model's tokenizer in a fine-tune: the data must have been tokenized with it, and each
checkpoint carries it (with its chat template and generation settings) so that transformers
loads the fine-tuned model as the original was loaded.

``check_tokenizer`` compares the vocabularies by hash (``data.tokenizer.vocab_hash``: every
token and its id, not only the size): data tokenized with another tokenizer of a vocabulary that
fits would otherwise train silently on ids that mean other tokens. ``--allow-other-tokenizer``
lets it through (pretraining a model from a directory whose tokenizer is not the data's).
``travelling_files`` names what a checkpoint copies. No torch: the command line checks this
before it imports torch.
"""
from __future__ import annotations

from pathlib import Path

from ..core.errors import TierflowError
from ..data.tokenizer import TOKENIZER_FILES
from ..models.presets import model_directory
from .data_dir import DataDir


def model_tokenizer_dir(model: str | None) -> Path | None:
    """The model directory when it holds a tokenizer.json, else None (a preset, or a model
    directory without a tokenizer)."""
    directory = model_directory(model) if model is not None else None
    return directory if directory is not None and (directory / "tokenizer.json").is_file() \
        else None


def check_tokenizer(model: str | None, data: DataDir, allow_other: bool) -> None:
    """One line when ``data`` was tokenized with another tokenizer than the model's."""
    directory = model_tokenizer_dir(model)
    if directory is None or allow_other or data.tokenizer_file is None:
        return
    from ..data.tokenizer import load_tokenizer, vocab_hash
    ours = vocab_hash(load_tokenizer(directory))
    theirs = data.vocab_hash or vocab_hash(load_tokenizer(data.tokenizer_file))
    if ours != theirs:
        raise TierflowError(f"--data {data.path} was tokenized with another tokenizer than the "
                            f"model's ({directory / 'tokenizer.json'}: vocabulary hash {ours}, "
                            f"the data's {theirs}); fix: tokenize again with 'tierflow tokenize "
                            f"... --tokenizer {directory}', or pass --allow-other-tokenizer")


def travelling_files(model: str | None, data: DataDir) -> tuple[Path | None, list[Path]]:
    """(tokenizer.json, the files beside it) that a checkpoint copies: the model directory's
    (tokenizer config, chat template, generation config) when it has a tokenizer, else the
    data's tokenizer with its config; a model's generation config travels either way."""
    directory = model_tokenizer_dir(model)
    source = directory if directory is not None else (
        data.tokenizer_file.parent if data.tokenizer_file is not None else None)
    if source is None:
        return None, []
    extras = [source / name for name in TOKENIZER_FILES[1:] if (source / name).is_file()]
    own = model_directory(model) if model is not None else None
    generation = own / "generation_config.json" if own is not None else None
    if generation is not None and generation.is_file() and generation not in extras:
        extras.append(generation)
    return source / "tokenizer.json", extras
