"""What a model directory must hold, read without torch or transformers: its ``config.json``
and the presence of safetensors weights. ``load.py`` raises these errors when it loads a
directory; the command line raises them before it imports torch (seconds on a small
machine), so a directory without weights or with a broken config is one line at once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import TierflowError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_config_json(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``directory``; one line if it is missing or not JSON."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise TierflowError(f"no config.json in {directory}: pass a directory written by "
                            "save_pretrained (config.json and model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise TierflowError(f"{config_file} is not valid JSON ({e}): fix or rewrite it") from None
    if not isinstance(config, dict):
        raise TierflowError(f"{config_file} holds {type(config).__name__}, not a JSON object: "
                            "fix or rewrite it")
    return config


def require_weight_files(directory: Path) -> None:
    """One line unless ``directory`` holds ``model.safetensors`` or a shard index (whose
    shards ``load.read_safetensors_index`` checks); pickle weights are refused by name."""
    if (directory / INDEX_NAME).is_file() or (directory / SINGLE_NAME).is_file():
        return
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise TierflowError(f"{directory} holds only pickle weights (.bin/.pt), which tierflow "
                            "never loads: convert them to model.safetensors with save_pretrained("
                            "..., safe_serialization=True) where you trust the file")
    raise TierflowError(f"no weights in {directory}: expected {SINGLE_NAME} or {INDEX_NAME} "
                        "with its shards (save the model with save_pretrained)")


def max_positions(config: Any) -> int | None:
    """The longest sequence a model config allows, when it says: Llama-style
    ``max_position_embeddings``, GPT-2's ``n_positions`` or ``max_sequence_length``, read from
    a transformers config or from a ``config.json``'s dict."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def vocab_and_positions(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """The vocabulary size and the maximum positions (``max_positions``) a ``config.json``
    states, None for what it leaves out (a config written with only its differences from the
    defaults may)."""
    vocab = config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    return vocab, max_positions(config)
