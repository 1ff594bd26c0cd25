"""The records one run of ``tierflow train`` is made of, handed down the loop instead of long
lists of parameters. ``loop.py`` makes each once, in this order, and none is replaced after:

- ``Run``: what the run is once its inputs are checked: the options, the checkpoint it
  resumes, the data, where it writes and its ``Schedule``;
- ``Site``: where it computes: the compute tier, the ranks under torchrun, the RSS baseline,
  the precision and the disk tier's directory;
- ``BuiltModel``: the model as built, whether on the disk tier, the identity a checkpoint
  of the run carries and, under ``--lora``, peft's wrapper of its adapters;
- ``Reports``: where it reports: the printed lines with the JSON log, and TensorBoard.

A GPU out-of-memory error re-plans the step under a smaller budget; that tier is the step
loop's own (``steps.StepLoop.tier``), the ``Site`` keeps the one the run started with.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .schedule import lr_at

if TYPE_CHECKING:
    from peft import PeftModel
    from torch import nn

    from ..distributed import World
    from ..precision import PrecisionConfig
    from .checkpoint import Checkpoint
    from .data_dir import DataDir
    from .device import ComputeTier
    from .logger import Logger
    from .options import TrainOptions
    from .tensorboard import EventWriter

DEFAULT_STEPS = 100  # optimizer steps without --steps or --epochs


@dataclass(frozen=True)
class Schedule:
    """The run's optimizer steps and learning rates: ``total`` steps, ``warmup`` of them
    linear, then a cosine down to ``min_lr``; ``tokens_per_step`` over all ranks."""
    total: int
    warmup: int
    min_lr: float
    tokens_per_step: int

    @classmethod
    def of(cls, opts: TrainOptions, train_tokens: int) -> Schedule:
        """From ``--steps`` (else ``--epochs`` passes over ``train_tokens``, else
        ``DEFAULT_STEPS``), ``--warmup`` (default 5% of the steps) and ``--min-lr`` (default
        ``--lr`` / 10)."""
        tokens_per_step = opts.batch_size * opts.grad_accum * opts.seq_len
        if opts.steps is not None:
            total = opts.steps
        elif opts.epochs is not None:
            total = max(1, math.ceil(opts.epochs * train_tokens / tokens_per_step))
        else:
            total = DEFAULT_STEPS
        warmup = opts.warmup if opts.warmup is not None else (total * 5) // 100
        min_lr = opts.min_lr if opts.min_lr is not None else opts.lr / 10
        return cls(total, warmup, min_lr, tokens_per_step)

    def lr(self, step: int, peak: float) -> float:
        """The learning rate of step ``step`` (1-based) for the peak rate ``peak``."""
        return lr_at(step - 1, lr=peak, warmup=self.warmup, total=self.total,
                     min_lr=self.min_lr)


@dataclass(frozen=True)
class Run:
    """One run after its checks, before anything is built: the options (a resumed run's
    completed with its checkpoint's, ``--out`` resolved), the checkpoint it resumes (or
    None), the checked data directory, the output directory, the JSON log's path and the
    ``Schedule`` of its steps."""
    opts: TrainOptions
    ckpt: Checkpoint | None
    data: DataDir
    out: Path
    log: Path
    schedule: Schedule


@dataclass(frozen=True)
class Site:
    """Where the run computes: the compute tier with its budgets, the ranks (None: one
    process), the RSS after the imports that ``--ram`` counts from, the precision, and the
    disk tier's directory (this run's scratch directory in ``--disk DIR``; None without one)."""
    tier: ComputeTier
    world: World | None
    baseline: int
    precision: PrecisionConfig
    disk: Path | None

    @property
    def ranks(self) -> int:
        """The processes that train: torchrun's ranks, or 1."""
        return self.world.size if self.world is not None else 1

    @property
    def is_main(self) -> bool:
        """Whether this process prints, logs and writes checkpoints (rank 0, or the only)."""
        return self.world is None or self.world.is_main

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast mode of the precision on the compute device, for a ``with``."""
        from ..precision import autocast_context
        return autocast_context(self.precision, self.tier.device.type)

    @property
    def rank_part(self) -> tuple[int, int]:
        """(this rank, ranks): which rows of each global batch this process takes."""
        return (self.world.rank, self.ranks) if self.world is not None else (0, 1)


@dataclass(frozen=True)
class BuiltModel:
    """The model a run trains, in training mode with its precision applied, built onto the
    disk tier (``on_disk``: it carries that tier with it) or in memory; ``identity`` is what
    decides its sequence of losses and ``run_hash`` its hash (``model.run_identity``).
    ``adapters``: under ``--lora``, the ``PeftModel`` around ``model`` (whose adapters were
    injected in place): checkpoints are its adapter directory (``adapter_files.py``)."""
    model: nn.Module
    on_disk: bool
    identity: dict[str, Any]
    run_hash: str
    adapters: PeftModel | None = None


@dataclass(frozen=True)
class Reports:
    """Where the run reports: ``logger`` prints (rank 0 only) and writes the JSON log,
    ``board`` the TensorBoard event files (``--tensorboard``; None without, or off rank 0)."""
    logger: Logger
    board: EventWriter | None

    @classmethod
    @contextlib.contextmanager
    def opened(cls, run: Run, site: Site) -> Iterator[Reports]:
        """The run's log (appended to when it resumes) and event files, closed at the end."""
        from .logger import Logger
        logger = Logger(run.log, append=run.ckpt is not None, active=site.is_main)
        board = None
        try:
            if run.opts.tensorboard and site.is_main:
                from .tensorboard import EventWriter
                board = EventWriter(run.opts.tensorboard)
            yield cls(logger, board)
        finally:
            if board is not None:
                board.close()
            logger.close()
