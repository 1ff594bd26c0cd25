"""The checks of ``tierflow train`` that need neither torch nor the model, made by the command
line before it imports torch and transformers (seconds on a small machine): a bad flag, model
path, data directory, output path or disk directory is then one error line at once; so is a
model directory without config.json or weights, and data or a --seq-len beyond the vocab or
positions its config.json states.

The run makes them again after the imports (``loop._train``): milliseconds, since the scan of
the token ids is remembered per file (``TokenFile.max_token``); the token files are read,
not mapped into the RSS, so nothing here changes the run's memory baseline. A run that
resumes is checked here only for a checkpoint to resume from: its options are the
checkpoint's until the checkpoint is read, which needs torch.
"""
from __future__ import annotations

from pathlib import Path

from ..core.paths import check_writable_dir, require_disk_directory, require_writable_dir
from ..core.torchrun_env import world_size_from_env
from ..data.packing import check_fits
from ..models.files import read_config_json, require_weight_files, vocab_and_positions
from ..models.presets import model_directory
from .checkpoint_dirs import checkpoint_directory
from .data_dir import DataDir, open_data
from .model_limits import check_model_limits
from .options import TrainOptions
from .tokenizer_match import check_tokenizer


def preflight(opts: TrainOptions) -> None:
    """Raise the one-line ``TierflowError`` that ``opts`` would meet before the model is built,
    without importing torch and without creating anything; nothing when they pass. A run that
    resumes is only checked for its checkpoint directory."""
    if opts.resume:
        checkpoint_directory(opts.resume)
        return
    opts.check_flags(world_size_from_env())
    directory = model_directory(opts.model)
    config = None
    if directory is not None:
        config = read_config_json(directory)
        require_weight_files(directory)
    data = check_paths(opts, create=False)
    if config is not None:
        check_model_limits(opts.model, opts.seq_len, data, *vocab_and_positions(config))


def check_paths(opts: TrainOptions, *, create: bool) -> DataDir:
    """Check ``--data`` (opened), the directories the run writes into (``--out``,
    ``--tensorboard``, ``--trace``'s; made with ``create``, else only checked that they could
    be) and ``--disk``; one line for the first that fails."""
    data = open_data(opts.data)
    check_tokenizer(opts.model, data, opts.allow_other_tokenizer)
    for tokens in (data.train, data.eval):
        if tokens is not None and tokens.mask is not None:  # packed: whole documents a row
            check_fits(tokens, opts.seq_len)
    writable = require_writable_dir if create else check_writable_dir
    writable(Path(opts.out) if opts.out else Path("out"), "--out")
    if opts.tensorboard:
        writable(opts.tensorboard, "--tensorboard")
    if opts.trace:
        writable(Path(opts.trace).parent, "--trace")
    if opts.disk:
        require_disk_directory(opts.disk)
    return data
