"""What makes every step of a run fail before it starts, apart from the weights: token ids
beyond the model's vocabulary, a sequence longer than its positions. Torch-free, so that the
command line checks them from ``config.json`` before it imports torch; ``build_model``
checks them again from the built model's config (a preset's, or a config.json that leaves
them at their defaults)."""
from __future__ import annotations

from ..core.errors import TierflowError
from .data_dir import DataDir


def check_model_limits(model: str, seq_len: int, data: DataDir, vocab: int | None,
                       positions: int | None) -> None:
    """One line if ``data`` holds a token id at or above ``vocab`` or ``seq_len`` is above
    ``positions`` (None: not known, not checked); ``model`` names the model in the line."""
    if vocab is not None and data.max_token >= vocab:
        raise TierflowError(f"--data {data.path} holds token id {data.max_token} but the model "
                            f"{model} has vocab size {vocab}: use a model whose vocab has at "
                            f"least {data.max_token + 1} ids, or tokenize with its tokenizer")
    if positions is not None and seq_len > positions:
        raise TierflowError(f"--seq-len {seq_len} is above the model's maximum positions "
                            f"({positions}): use --seq-len {positions} or less")
