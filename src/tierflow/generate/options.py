"""The sampling defaults of ``tierflow generate`` and the checks of what it (and ``tierflow
quantize``) is asked, apart from ``sample.py`` and free of torch: the command line shows the
defaults in its help and turns bad input into one error line before it imports torch (seconds
on a small machine)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.errors import TierflowError
from ..core.units import parse_bytes
from ..exec.enforce import check_flags as check_enforce_flags
from ..models.files import read_config_json, require_weight_files
from ..train.checkpoint_dirs import latest_checkpoint

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


@dataclass(frozen=True)
class Sampling:
    """How many new ids, and how each is picked (the part of transformers' ``GenerationConfig``
    that tierflow's loop reads), checked as it is made: ``temperature`` 0 is greedy, else
    ``softmax(logits / temperature)`` over the ``top_k`` largest (None: all), drawn from a
    generator seeded with ``seed`` (None: a fresh seed)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_options(self.max_new_tokens, self.temperature, self.top_k)


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


@dataclass(frozen=True)
class GenerateRequest:
    """What ``tierflow generate`` is asked, as one record: the model directory (or a run's
    ``--out``), the prompts (several run in turn on one loaded model), the sampling options,
    and the memory terms (``ram``; ``enforce`` and ``unenforced_ok`` as train's)."""

    model: str | Path
    prompts: tuple[str, ...]
    tokenizer: str | Path | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = None
    seed: int | None = None
    dtype: str = "auto"
    ram: str | int | None = None
    chat: bool = False  # each prompt is a user message, rendered by the chat template
    enforce: bool = False
    unenforced_ok: bool = False

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_k, self.seed)

    @classmethod
    def of(cls, model: str | Path, prompt: str | Sequence[str], **options) -> GenerateRequest:
        """A request for one prompt or several."""
        prompts = (prompt,) if isinstance(prompt, str) else tuple(prompt)
        return cls(model=model, prompts=prompts, **options)


def check_request(request: GenerateRequest) -> tuple[Path, Path, int | None]:
    """Check a ``tierflow generate`` request before anything is loaded; returns the model
    directory (the request's itself, or the latest checkpoint of a run's ``--out``
    directory), the tokenizer file and the RAM budget in bytes (None: no budget). With
    ``chat`` the tokenizer needs a chat template."""
    check_options(request.max_new_tokens, request.temperature, request.top_k)
    check_enforce_flags(request.enforce, request.unenforced_ok, request.ram)
    prompts, tokenizer, ram = request.prompts, request.tokenizer, request.ram
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise TierflowError("the prompt is empty: give some text with --prompt")
    directory = checkpoint_directory(request.model)
    if tokenizer is not None:
        from ..data.tokenizer import tokenizer_file
        tok_path = tokenizer_file(Path(tokenizer))
    else:
        tok_path = directory / "tokenizer.json"
        if not tok_path.is_file():
            raise TierflowError(f"no tokenizer.json in {directory}: pass --tokenizer PATH (the "
                                "tokenizer.json the model was trained with)")
    if request.chat:
        from ..data.tokenizer import has_chat_template
        if not has_chat_template(tok_path.parent):
            raise TierflowError(f"--chat: the tokenizer in {tok_path.parent} has no chat "
                                "template (no chat_template in tokenizer_config.json, no "
                                "chat_template.jinja); fix: give an instruct model's directory "
                                "(or --tokenizer DIR holding its tokenizer files), or drop "
                                "--chat to continue the prompt as plain text")
    budget = parse_bytes(ram, what="--ram") if ram is not None else None
    return directory, tok_path, budget
