"""The checks of ``tierflow train`` that need neither torch nor the model, made by the command
line before it imports torch and transformers (seconds on a small machine): a bad flag, model
path, data directory, output path or disk directory is then one error line at once.

The run makes them again after the imports (``loop._train``): milliseconds, besides a second
scan of the token ids, which grows with the corpus. That keeps its memory baseline as it
was: the token files mapped here are unmapped again before the run's RSS baseline is read.
A run that resumes is not checked here: its options are the checkpoint's until the
checkpoint is read, which needs torch.
"""
from __future__ import annotations

from pathlib import Path

from ..models.presets import model_directory
from ..paths import check_writable_dir, require_disk_directory, require_writable_dir
from ..torchrun_env import world_size_from_env
from .data_dir import DataDir, open_data
from .options import TrainOptions


def preflight(opts: TrainOptions) -> None:
    """Raise the one-line ``TierflowError`` that ``opts`` would meet before the model is built,
    without importing torch and without creating anything; nothing when they pass or when the
    run resumes."""
    if opts.resume:
        return
    opts.check_flags(world_size_from_env())
    model_directory(opts.model)
    check_paths(opts, create=False)  # the data directory it opens is dropped (unmapped) here


def check_paths(opts: TrainOptions, *, create: bool) -> DataDir:
    """Check ``--data`` (opened), the directories the run writes into (``--out``,
    ``--tensorboard``, ``--trace``'s; made with ``create``, else only checked that they could
    be) and ``--disk``; one line for the first that fails."""
    data = open_data(opts.data)
    writable = require_writable_dir if create else check_writable_dir
    writable(Path(opts.out) if opts.out else Path("out"), "--out")
    if opts.tensorboard:
        writable(opts.tensorboard, "--tensorboard")
    if opts.trace:
        writable(Path(opts.trace).parent, "--trace")
    if opts.disk:
        require_disk_directory(opts.disk)
    return data
