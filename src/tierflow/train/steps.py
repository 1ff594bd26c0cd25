"""The step loop of ``tierflow train``, once the step is planned and the optimizer built.

Per optimizer step: ``grad_accum`` micro-batches forward and backward under autocast, the
loss averaged over the ranks, global-norm clipping (a non-finite loss or norm stops the run,
naming the last good checkpoint), the update, then one ``[T]`` line, one JSON record and
TensorBoard scalars. ``[V]`` evaluations every ``--eval-every`` steps and checkpoints every
``--save-every`` steps, at the end and on Ctrl-C (``guards.Interrupt``: every rank saves or
none). A GPU out-of-memory error in a step re-plans it (``StepPlanner.replan_after_oom``) and
runs it once more from the same batch and RNG state.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ..errors import TierflowError
from ..profile.machine import maxrss_bytes
from ..units import format_bytes
from . import checkpoint
from .checkpoint_dirs import latest_checkpoint
from .codec import capture_rng, restore_rng
from .data import Batches
from .data_dir import DataDir
from .device import ComputeTier
from .guards import Interrupt, traced
from .logger import Logger, eval_line, near_budget, train_line
from .options import TrainOptions
from .planning import StepPlanner
from .schedule import lr_at

INTERRUPTED = 130


@dataclasses.dataclass
class StepLoop:
    """One run's steps. ``module`` and ``tier`` change when a GPU out-of-memory error
    re-plans the step; ``sol`` in the ``[T]`` lines is ``flops_per_step`` over the step's
    time and ``peak``."""
    opts: TrainOptions
    model: nn.Module
    module: Any  # the TierflowModule of tierflow.fit
    optimizer: Any  # LocalOptimizer, ShardedOptimizer or FitOwnedOptimizer
    planner: StepPlanner
    tier: ComputeTier
    batches: Batches
    evals: list[torch.Tensor]
    data: DataDir
    out: Path
    logger: Logger
    board: Any  # tensorboard.EventWriter or None
    world: Any  # dist.World or None
    autocast: Callable[[], ContextManager]
    identity: dict
    run_hash: str
    total: int
    warmup: int
    min_lr: float
    tokens_per_step: int
    baseline: int
    flops_per_step: float  # the model's training FLOPs of one step's tokens
    peak: float  # the matmul FLOP/s of the compute tier
    near_budget_said: bool = False  # the warning of a peak within NEAR_BUDGET of --ram, once

    @property
    def ranks(self) -> int:
        return self.world.size if self.world is not None else 1

    def run(self, start: int) -> int:
        """Steps ``start + 1`` to ``total``, the last evaluation and checkpoint; the exit code
        (``INTERRUPTED`` after Ctrl-C, once the step is saved)."""
        opts, total, logger = self.opts, self.total, self.logger
        if start >= total:
            logger.print(f"\nthe checkpoint is at step {start}, the run has {total} steps: "
                         "nothing to do (raise --steps to train further)")
            return 0
        logger.print()
        last_saved = start if start > 0 else None  # a resumed run's checkpoint is at start
        rank = self.world.rank if self.world is not None else 0
        plan_of = lambda: self.module.plan  # noqa: E731 (a re-plan replaces it)
        with Interrupt() as interrupt, traced(opts.trace, logger, plan_of, rank):
            for step in range(start + 1, total + 1):
                t0 = time.perf_counter()
                if self.world is not None:
                    self.world.step = step
                lr = lr_at(step - 1, lr=opts.lr, warmup=self.warmup, total=total,
                           min_lr=self.min_lr)
                self.optimizer.set_lr(lr)
                loss, norm = self._step(step)
                step_s = time.perf_counter() - t0
                stop = self._report(step, lr, loss, norm, step_s, interrupt.requested)
                if self.evals and opts.eval_every and step % opts.eval_every == 0:
                    self._evaluate(step)
                if opts.save_every and step % opts.save_every == 0 and step != total:
                    self._save(step)
                    last_saved = step
                if stop and step != total:
                    path = self._save(step)
                    logger.print(f"interrupted: saved step {step} to {path}; continue with "
                                 f"--resume {path}")
                    logger.record("interrupted", step=step, path=str(path))
                    return INTERRUPTED
                logger.bar(step, total, step_s)
        if self.evals and opts.eval_every and total % opts.eval_every != 0:
            self._evaluate(total)
        path = self._save(total) if last_saved != total else self.out / f"step_{total}"
        if self.world is not None:
            self.world.barrier("end of the run")  # rank 0 has written the last checkpoint
        logger.print(f"done: {total} steps; saved {path}")
        logger.record("done", step=total, path=str(path))
        return 0

    def _step(self, step: int) -> tuple[float, float]:
        """Forward, backward (retried once after a GPU out-of-memory error), clipping and the
        update; the step's loss (mean over the ranks) and gradient norm."""
        retry = self.tier.gpu is not None  # a GPU plan of ours to shrink
        position, rng = self.batches.index, capture_rng() if retry else None
        owned = self.module.optimizer
        updates = owned.updates if owned is not None else 0
        try:
            loss = self._forward_backward()
        except torch.OutOfMemoryError:
            if not retry:
                raise
            loss = None  # re-planned below, once the handler has let the error go
        if loss is None:
            if owned is not None and owned.updates != updates:
                raise self._not_rerun(step, owned.updates - updates)
            self.module, self.tier = self.planner.replan_after_oom(self.module, self.tier,
                                                                   self.optimizer, step)
            self.batches.index = position
            restore_rng(rng)
            try:
                loss = self._forward_backward()
            except torch.OutOfMemoryError:
                raise TierflowError(
                    f"the GPU ran out of memory again at step {step}, under the re-planned "
                    f"budget of {format_bytes(self.tier.gpu)}: give a smaller --gpu (what else "
                    "uses the GPU is not in the budget) or a smaller --batch-size") from None
        if self.world is not None:  # the ranks' means of equal row counts: the global mean
            means = self.world.all_gather([loss], "loss average")
            loss = sum(r[0] for r in means) / self.ranks
        clip = self.opts.clip
        norm = self.optimizer.clip_grad_norm(clip if clip > 0 else math.inf)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
            self.logger.record("error", step=step, loss=loss, norm=norm)
            good = latest_checkpoint(self.out)
            raise TierflowError(f"the {what} at step {step}: training stopped, nothing saved "
                                f"for this step; the last good checkpoint is "
                                f"{good if good else 'none (no checkpoint was written)'}; fix: "
                                "lower --lr, raise --warmup or set --clip")
        self.module.make_room(self.planner.step_temporaries)  # what the plan reserved for it
        self.optimizer.step()
        return loss, norm

    def _not_rerun(self, step: int, updated: int) -> TierflowError:
        """The error of a GPU out-of-memory error after ``updated`` stages' updates began."""
        good = latest_checkpoint(self.out)
        self.logger.record("error", step=step, out_of_memory=True, stages_updated=updated)
        again = (f"continue with --resume {good} and a smaller --gpu" if good else
                 "start again with a smaller --gpu (no checkpoint was written)")
        return TierflowError(f"the GPU ran out of memory at step {step} after {updated} "
                             "stage(s) were updated, so the step cannot run again: "
                             f"{again}; what else uses the GPU is not in the budget")

    def _forward_backward(self) -> float:
        """One step's micro-batches, forward and backward; their mean loss."""
        micro = []
        accum = self.opts.grad_accum
        for k in range(accum):
            self.optimizer.micro_batch(last=k == accum - 1)
            batch = self.batches.next().to(self.tier.device)  # (rows, seq_len + 1)
            with self.autocast():
                loss = self.module(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
            (loss / accum).backward()
            micro.append(loss.detach().float())
        return float(torch.stack(micro).mean())

    def _report(self, step: int, lr: float, loss: float, norm: float, step_s: float,
                interrupted: bool) -> bool:
        """The step's ``[T]`` line, record and scalars, with every rank's peak RSS above the
        baseline; whether any rank was interrupted (then every rank saves)."""
        ram = max(0, maxrss_bytes() - self.baseline)
        per_rank = [[ram, self.optimizer.state_bytes(), interrupted]]
        if self.world is not None:
            per_rank = self.world.all_gather(per_rank[0], "memory report")
        ram_ranks = [int(r[0]) for r in per_rank]
        sol = self.flops_per_step / (step_s * self.peak * self.ranks) if self.peak > 0 else None
        tok_s = self.tokens_per_step / step_s
        tier = self.tier
        self.logger.print(train_line(step=step, total=self.total, ms=step_s * 1e3, norm=norm,
                                     loss=loss, tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                                     budget=tier.rss_budget, gpu_bytes=tier.gpu_peak(),
                                     gpu_budget=tier.gpu))
        warning = near_budget(max(ram_ranks), tier.rss_budget)
        if warning and not self.near_budget_said:
            self.near_budget_said = True
            self.logger.print(warning)
        self.logger.record("train", step=step, total=self.total, loss=loss, norm=norm, lr=lr,
                           ms=step_s * 1e3, tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                           ram_bytes_per_rank=ram_ranks, budget=tier.rss_budget,
                           gpu_bytes=tier.gpu_peak(), gpu_budget=tier.gpu,
                           optimizer_state_bytes_per_rank=[int(r[1]) for r in per_rank],
                           tokens=step * self.tokens_per_step)
        if self.board is not None:
            self.board.scalars(step, {"train/loss": loss, "train/grad_norm": norm,
                                      "train/lr": lr, "train/tok_s": tok_s,
                                      "memory/ram_bytes": max(ram_ranks)})
        return any(r[2] for r in per_rank)

    def _evaluate(self, step: int) -> None:
        """The mean loss over the evaluation batches (split over the ranks): a ``[V]`` line."""
        t0 = time.perf_counter()
        self.model.eval()
        world, ranks = self.world, self.ranks
        mine = self.evals if world is None else self.evals[world.rank::ranks]  # whole batches
        with torch.no_grad(), self.autocast():
            losses = [float(self.module(input_ids=b[:, :-1], shift_labels=b[:, 1:]).loss)
                      for b in (b.to(self.tier.device) for b in mine)]
        self.model.train()
        total_loss, count = sum(losses), len(losses)
        if world is not None:
            per_rank = world.all_gather([total_loss, count], "evaluation loss average")
            total_loss, count = sum(r[0] for r in per_rank), sum(r[1] for r in per_rank)
        loss = total_loss / count
        ms = (time.perf_counter() - t0) * 1e3
        ppl = math.exp(min(loss, 700.0))
        self.logger.print(eval_line(step=step, loss=loss, ppl=ppl, ms=ms))
        self.logger.record("eval", step=step, loss=loss, ppl=ppl, ms=ms,
                           tokens=step * self.tokens_per_step)
        if self.board is not None:
            self.board.scalars(step, {"eval/loss": loss})

    def _save(self, step: int) -> Path:
        """Checkpoint ``step`` (rank 0 writes; every rank gathers its optimizer shard). With
        ``--disk`` the weights and states are read from the disk tier as they are written."""
        opts, optimizer = self.opts, self.optimizer
        main = self.world is None or self.world.is_main
        if opts.disk:
            if not main:  # replicas: rank 0's weights and states are every rank's
                return self.out / f"step_{step}"
            from ..exec.offload import offloaded_parameters
            optimizer.settle()
            offloaded = offloaded_parameters(self.model)
            optimizer_state = optimizer.skeleton()
            stream = {"materialize_optimizer": optimizer.materialize,
                      "materialize_weights": lambda name, t: offloaded.current_copy(t)
                      if t in offloaded else t}
        else:
            optimizer_state = optimizer.state_dict()  # gathered on rank 0 (every rank calls it)
            stream = {}
        if not main:
            return self.out / f"step_{step}"
        try:
            path = checkpoint.save_checkpoint(
                self.out, step, self.model, tokenizer_file=self.data.tokenizer_file,
                optimizer_state=[optimizer_state], **stream,
                trainer_state={"step": step, "data": self.batches.state(), "rng": capture_rng(),
                               "identity": self.identity, "config_hash": self.run_hash,
                               "options": opts.as_dict(), "total_steps": self.total,
                               "tokens": step * self.tokens_per_step})
        finally:
            if opts.disk:
                optimizer.finished_writing()  # drop the last stage's states read for it
        self.logger.record("checkpoint", step=step, path=str(path))
        return path
