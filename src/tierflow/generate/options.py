"""The sampling defaults of ``tierflow generate`` and the checks of what it (and ``tierflow
quantize``) is asked, apart from ``sample.py`` and free of torch: the command line shows the
defaults in its help and turns bad input into one error line before it imports torch (seconds
on a small machine)."""
from __future__ import annotations

import math
import os
from pathlib import Path

from ..enforce import check_flags as check_enforce_flags
from ..errors import TierflowError
from ..models.files import read_config_json, require_weight_files
from ..train.checkpoint_dirs import latest_checkpoint
from ..units import parse_bytes

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TEMPERATURE = 0.8


def check_options(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Reject out-of-range sampling options with a one-line error naming the fix."""
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1):
        raise TierflowError(f"--max-new-tokens {max_new_tokens!r} must be a whole number of at "
                            "least 1")
    if (not isinstance(temperature, (int, float)) or not math.isfinite(temperature)
            or temperature < 0):
        raise TierflowError(f"--temperature {temperature!r} must be a finite number >= 0 "
                            "(0 picks the most likely token)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise TierflowError(f"--top-k {top_k!r} must be a whole number of at least 1 (or left "
                            "out to sample from the whole vocabulary)")


def checkpoint_directory(model_dir: str | Path) -> Path:
    """The model directory ``--model`` names: ``model_dir`` itself, or the latest checkpoint
    of a ``tierflow train --out`` directory; one line unless it has a config and weights."""
    directory = Path(model_dir)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise TierflowError(f"--model {directory} {what}: pass a checkpoint directory with "
                            "config.json and model.safetensors (e.g. OUT/step_N from tierflow "
                            "train, or OUT for its latest)")
    if not (directory / "config.json").is_file():  # a run's --out: its latest checkpoint
        directory = latest_checkpoint(directory) or directory
    read_config_json(directory)
    require_weight_files(directory)
    return directory


def check_new_directory(out: Path) -> None:
    """``--out`` of ``tierflow quantize``: a new directory in an existing, writable one."""
    if out.exists():
        raise TierflowError(f"--out {out} already exists: give a new directory (tierflow "
                            "quantize never overwrites)")
    parent = out.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise TierflowError(f"--out {out}: {parent} is not a writable directory: create it or "
                            "give another --out")


def check_request(model_dir: str | Path, prompt: str, *, tokenizer: str | Path | None,
                  max_new_tokens: int, temperature: float, top_k: int | None,
                  ram: str | int | None, enforce: bool = False,
                  unenforced_ok: bool = False) -> tuple[Path, Path, int | None]:
    """Check a ``tierflow generate`` request before anything is loaded; returns the model
    directory (``model_dir`` itself, or the latest checkpoint of a run's ``--out`` directory),
    the tokenizer file and the RAM budget in bytes (None: no budget). ``enforce`` and
    ``unenforced_ok`` are train's ``--enforce`` and ``--unenforced-ok``."""
    check_options(max_new_tokens, temperature, top_k)
    check_enforce_flags(enforce, unenforced_ok, ram)
    if not prompt:
        raise TierflowError("the prompt is empty: give some text with --prompt")
    directory = checkpoint_directory(model_dir)
    if tokenizer is not None:
        from ..data.tokenizer import tokenizer_file
        tok_path = tokenizer_file(Path(tokenizer))
    else:
        tok_path = directory / "tokenizer.json"
        if not tok_path.is_file():
            raise TierflowError(f"no tokenizer.json in {directory}: pass --tokenizer PATH (the "
                                "tokenizer.json the model was trained with)")
    budget = parse_bytes(ram, what="--ram") if ram is not None else None
    return directory, tok_path, budget
