"""Evaluation: the mean loss of a model over fixed batches of a token file, normalised over the
tokens the loss counts. ``tierflow train``'s ``[V]`` evaluations (``steps.StepLoop``) and
``tierflow eval`` both compute it here, through the planned module of the training step.

``evaluation_batches`` are a file's fixed batches: consecutive windows of a plain token file
(every token a target), or, for a file with a loss mask (fine-tuning records), its whole
documents packed into rows that attend within their documents, the targets those of the mask
(``packing.packed_eval_batches``), exactly as training draws them. ``evaluation_loss`` is each
batch's mean loss over its targets, weighted by their count: the summed loss over every
counted token, and that count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from ..data.tokenfile import TokenFile
from .data import eval_batches
from .packing import packed_eval_batches, step_inputs, targets

if TYPE_CHECKING:
    from .data_dir import DataDir
    from .options import TrainOptions


def evaluation_batches(tokens: TokenFile, seq_len: int, batch_size: int, steps: int, *,
                       whole: bool = False) -> list[Any]:
    """Up to ``steps`` batches of ``tokens``: packed documents when it has a loss mask, else
    windows of ``seq_len + 1`` (``whole``: the windows left after the last full batch too)."""
    if tokens.mask is not None:
        return packed_eval_batches(tokens, seq_len, batch_size, steps)
    return eval_batches(tokens, seq_len, batch_size, steps, whole=whole)


def evaluation_loss(module: Any, batches: list[Any], device: torch.device,
                    autocast: contextlib.AbstractContextManager) -> tuple[float, int]:
    """(the summed loss over the counted tokens, their count) of ``module`` (the planned
    training module, or any callable that takes the step's keyword arguments and returns an
    output with ``.loss``) on ``batches``, without gradients under ``autocast``."""
    total, count = 0.0, 0
    with torch.no_grad(), autocast:
        for batch in batches:
            counted = targets(batch)
            if counted == 0:  # a packed row of prompts only
                continue
            loss = module(**step_inputs(batch, device, counted)).loss
            total += float(loss) * counted
            count += counted
    return total, count


@dataclass(frozen=True)
class Evaluation:
    """One token file's evaluation: the mean ``loss`` over the ``tokens`` it counts (a loss
    mask's targets, or every token after the first of each window), in ``rows`` rows of
    ``seq_len`` tokens (``packed`` documents, or windows) in ``batches`` batches of at most
    ``batch_size`` rows."""
    path: Path
    loss: float
    tokens: int
    batches: int
    batch_size: int
    rows: int
    seq_len: int
    packed: bool
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    def line(self) -> str:
        """The one line ``tierflow eval`` prints for the file."""
        rows = "packed rows" if self.packed else "windows"
        return (f"{self.path}: loss {self.loss:.4f} | ppl {self.perplexity:.2f} | "
                f"{self.tokens:,} tokens counted in {self.rows:,} {rows} of {self.seq_len} | "
                f"{self.seconds * 1e3:.0f} ms")

    def record(self) -> dict[str, Any]:
        """The line as a JSON object (``tierflow eval --json``)."""
        return {"file": str(self.path), "loss": self.loss, "ppl": self.perplexity,
                "tokens": self.tokens, "rows": self.rows, "batches": self.batches,
                "batch_size": self.batch_size,
                "seq_len": self.seq_len, "packed": self.packed, "ms": self.seconds * 1e3}


def evaluate_files(opts: TrainOptions, datas: list[DataDir], *, max_batches: int | None = None,
                   log: TextIO | None = None) -> list[Evaluation]:
    """``tierflow eval``: the loss of ``opts.model`` (a model directory) on each token file
    of ``datas`` (``data_dir.open_token_file``, checked), computed as ``tierflow train``
    evaluates: the model built by ``model.build_model`` with the precision of ``opts``, the
    step planned by ``planning.StepPlanner`` under ``--ram``/``--gpu``/``--disk`` (weights
    streamed as its plan says), then ``evaluation_loss`` over each file's batches (all of
    them, or the first ``max_batches``). A plan needs a parameter that trains: only the last
    of the smallest (the final norm) does, so the decoder layers before it run forward only
    and the plan reserves next to nothing for an optimizer. The plan goes to ``log``
    (stderr) when a budget is given."""
    import transformers.modeling_utils  # noqa: F401  (part of the RSS baseline, as in train)

    from ..profile.machine import fast_bf16, run_baseline
    from .device import ComputeTier
    from .logger import Logger
    from .model import build_model
    from .planning import StepPlanner
    from .roles import fit_owns_optimizer
    from .run import BuiltModel, Run, Schedule, Site

    baseline = run_baseline()
    log = log if log is not None else sys.stderr
    opts.validate()
    tier = ComputeTier.from_options(opts)
    precision = opts.precision(fast_bf16())
    first = datas[0]
    run = Run(opts, None, first, Path(opts.out or "."), Path(os.devnull),
              Schedule.of(opts, len(first.train)))
    results = []
    with contextlib.ExitStack() as scratch:
        disk = None
        if opts.disk:
            from ..exec.disk import scratch_directory
            disk = scratch.enter_context(scratch_directory(opts.disk))
        site = Site(tier, None, baseline, precision, disk)
        on_disk = disk is not None and tier.gpu is None
        model, _ = build_model(run, precision, disk if on_disk else None)
        _train_only_the_last_smallest(model)
        if not fit_owns_optimizer(opts):
            model = tier.place_model(model)
        elif tier.simulated and not on_disk:
            from ..exec.host_model import start_in_host_ram
            start_in_host_ram(model, tier.device)
        logger = Logger(None, out=log, active=tier.ram is not None or tier.gpu is not None)
        planner = dataclasses.replace(
            StepPlanner.for_run(run, site, BuiltModel(model, on_disk, {}, ""), logger),
            progress=False)
        module = planner.plan(tier)
        planner.report(module)
        model.eval()
        for data in datas:
            start = time.perf_counter()
            batches = evaluation_batches(data.eval, opts.seq_len, opts.batch_size,
                                         max_batches or sys.maxsize, whole=True)
            total, count = evaluation_loss(module, batches, tier.device, site.autocast())
            loss = total / count if count else float("nan")
            rows = sum(len(b["input_ids"] if isinstance(b, dict) else b) for b in batches)
            results.append(Evaluation(Path(data.eval.path), loss, count, len(batches),
                                      opts.batch_size, rows, opts.seq_len,
                                      data.eval.mask is not None,
                                      time.perf_counter() - start))
    return results


def _train_only_the_last_smallest(model: Any) -> None:
    """Freeze every parameter but the last of the smallest (in ``parameters()`` order: a
    decoder's final norm), which the plan of a step needs to train."""
    params = list(model.parameters())
    smallest = min(p.numel() for p in params)
    keep = [p for p in params if p.numel() == smallest][-1]
    for p in params:
        p.requires_grad_(p is keep)
