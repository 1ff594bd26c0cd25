"""The step loop of ``tierflow train``, once the step is planned and the optimizer built.

A resumed run first restores the optimizer's states, the data position and every RNG from
its checkpoint. Per optimizer step: ``grad_accum`` micro-batches forward and backward under
autocast, the loss averaged over the ranks, global-norm clipping (a non-finite loss or norm
stops the run, naming the last good checkpoint), the update, then one ``[T]`` line, one JSON
record and TensorBoard scalars. ``[V]`` evaluations every ``--eval-every`` steps and
checkpoints every ``--save-every`` steps, at the end and on Ctrl-C (``guards.Interrupt``:
every rank saves or none). A GPU out-of-memory error in a step re-plans it
(``StepPlanner.replan_after_oom``) and runs it once more from the same batch and RNG state.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TierflowError
from ..core.seeding import derived_seed
from ..core.units import format_bytes
from ..plan.reductions import LOSS, MEMORY_REPORT
from ..profile.machine import maxrss_bytes
from . import checkpoint
from .adapter_files import Current, adapter_weights, merged_weights
from .checkpoint_dirs import latest_checkpoint
from .codec import capture_rng, restore_rng
from .data import Batches
from .device import ComputeTier
from .evaluate import evaluation_batches, evaluation_loss
from .guards import Interrupt, traced
from .logger import StepLine, eval_line, near_budget
from .packing import PackedBatches, step_inputs, targets
from .planning import StepPlanner
from .roles import fit_owns_optimizer
from .run import BuiltModel, Reports, Run, Site
from .sol import model_flops_per_token
from .tokenizer_match import travelling_files

INTERRUPTED = 130


@dataclasses.dataclass
class StepLoop:
    """One run's steps: ``run`` on ``site`` training ``built``, reporting to ``reports``,
    with the step that ``planner`` planned as ``module`` and ``optimizer`` (LocalOptimizer,
    ShardedOptimizer or FitOwnedOptimizer). ``module`` and ``tier`` change when a GPU
    out-of-memory error re-plans the step; ``sol`` in the ``[T]`` lines is the model's
    training FLOPs of a step over the step's time and ``peak``, the compute tier's matmul
    FLOP/s (0: not measured, no SOL)."""
    run: Run
    site: Site
    built: BuiltModel
    reports: Reports
    planner: StepPlanner
    module: Any  # the TierflowModule of tierflow.fit
    optimizer: Any
    peak: float
    tier: ComputeTier = dataclasses.field(init=False)
    # this rank's rows of the train batches: windows, or packed documents (fine-tuning data)
    batches: Batches | PackedBatches = dataclasses.field(init=False)
    flops_per_step: float = dataclasses.field(init=False)  # the model's, of one step's tokens
    near_budget_said: bool = dataclasses.field(init=False, default=False)  # warned, once

    def __post_init__(self) -> None:
        opts = self.run.opts
        self.tier = self.site.tier
        kind = PackedBatches if self.run.data.train.mask is not None else Batches
        self.batches = kind(self.run.data.train, opts.seq_len, opts.batch_size, opts.seed,
                            part=self.site.rank_part)
        self.flops_per_step = model_flops_per_token(self.built.model, opts.seq_len) \
            * self.run.schedule.tokens_per_step

    def run_steps(self) -> int:
        """Resume (or seed), then steps ``start + 1`` to ``total``, the last evaluation and
        checkpoint; the exit code (``INTERRUPTED`` after Ctrl-C, once the step is saved)."""
        start = self._resume()
        evals = self._eval_batches()
        opts, schedule, logger = self.run.opts, self.run.schedule, self.reports.logger
        total = schedule.total
        if start >= total:
            logger.print(f"\nthe checkpoint is at step {start}, the run has {total} steps: "
                         "nothing to do (raise --steps to train further)")
            return 0
        logger.print()
        last_saved = start if start > 0 else None  # a resumed run's checkpoint is at start
        world = self.site.world
        rank = world.rank if world is not None else 0
        plan_of = lambda: self.module.plan  # noqa: E731 (a re-plan replaces it)
        with Interrupt() as interrupt, traced(opts.trace, logger, plan_of, rank):
            for step in range(start + 1, total + 1):
                t0 = time.perf_counter()
                if world is not None:
                    world.step = step
                lr = schedule.lr(step, opts.lr)
                self.optimizer.set_lr(lr)
                loss, norm = self._step(step)
                step_s = time.perf_counter() - t0
                stop = self._report(step, lr, loss, norm, step_s, interrupt.requested)
                if evals and opts.eval_every and step % opts.eval_every == 0:
                    self._evaluate(step, evals)
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
        if evals and opts.eval_every and total % opts.eval_every != 0:
            self._evaluate(total, evals)
        path = self._save(total) if last_saved != total else self.run.out / f"step_{total}"
        if world is not None:
            world.barrier("end of the run")  # rank 0 has written the last checkpoint
        logger.print(f"done: {total} steps; saved {path}")
        logger.record("done", step=total, path=str(path))
        return 0

    def _resume(self) -> int:
        """The step the run starts after: a checkpoint's, with the optimizer's states (fit's
        own stage by stage, straight to their tiers), the data position and every RNG
        restored; else 0, with torch seeded from ``--seed``. Under torchrun each rank then
        draws its own dropout masks, not rank 0's."""
        opts, ckpt, logger = self.run.opts, self.run.ckpt, self.reports.logger
        start = 0
        if ckpt is not None:
            if fit_owns_optimizer(opts):
                self.optimizer.load_checkpoint(ckpt)
            elif ckpt.optimizer is not None:
                self.optimizer.load_state_dict(ckpt.optimizer_state[0])
            self.batches.index = int(ckpt.trainer_state["data"]["index"])
            restore_rng(ckpt.trainer_state["rng"])
            start = ckpt.step
            logger.print(f"\nresumed from {ckpt.path} at step {start}")
            logger.record("resume", path=str(ckpt.path), step=start)
        else:
            torch.manual_seed(opts.seed)
        world = self.site.world
        if world is not None and world.rank > 0:
            torch.manual_seed(derived_seed(opts.seed, "rank", world.rank, "step", start))
        return start

    def _eval_batches(self) -> list[torch.Tensor]:
        """The fixed evaluation batches (none without ``--eval-every`` or eval.bin, or when
        eval.bin holds less than one window: then a note says evaluation is off)."""
        opts, data = self.run.opts, self.run.data
        if not (opts.eval_every and data.eval is not None):
            return []
        evals = evaluation_batches(data.eval, opts.seq_len, opts.batch_size, opts.eval_steps)
        if not evals:
            self.reports.logger.print(f"note: eval.bin holds {len(data.eval)} tokens, less "
                                      f"than one window of {opts.seq_len + 1}: evaluation is "
                                      "off")
        return evals

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
        if self.site.world is not None:  # the ranks' means of equal row counts: the mean
            means = self.module.exchange(LOSS, [loss])  # the plan's Exchange
            loss = sum(r[0] for r in means) / self.site.ranks
        clip = self.run.opts.clip
        norm = self.optimizer.clip_grad_norm(clip if clip > 0 else math.inf)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
            self.reports.logger.record("error", step=step, loss=loss, norm=norm)
            good = latest_checkpoint(self.run.out)
            raise TierflowError(f"the {what} at step {step}: training stopped, nothing saved "
                                f"for this step; the last good checkpoint is "
                                f"{good if good else 'none (no checkpoint was written)'}; fix: "
                                "lower --lr, raise --warmup or set --clip")
        self.module.make_room(self.planner.step_temporaries)  # what the plan reserved for it
        self.optimizer.step()
        self.module.gather_parameters()  # ZeRO-2: every rank's updated shards (the plan's)
        return loss, norm

    def _not_rerun(self, step: int, updated: int) -> TierflowError:
        """The error of a GPU out-of-memory error after ``updated`` stages' updates began."""
        good = latest_checkpoint(self.run.out)
        self.reports.logger.record("error", step=step, out_of_memory=True,
                                   stages_updated=updated)
        again = (f"continue with --resume {good} and a smaller --gpu" if good else
                 "start again with a smaller --gpu (no checkpoint was written)")
        return TierflowError(f"the GPU ran out of memory at step {step} after {updated} "
                             "stage(s) were updated, so the step cannot run again: "
                             f"{again}; what else uses the GPU is not in the budget")

    def _forward_backward(self) -> float:
        """One step's micro-batches, forward and backward; their mean loss (packed batches:
        the step's summed loss over its targets, ``packing.step_inputs``)."""
        micro = []
        accum = self.run.opts.grad_accum
        batches = [self.batches.next() for _ in range(accum)]  # window or packed batches
        packed = isinstance(batches[0], dict)
        counted = sum(targets(b) for b in batches) if packed else None
        for k, batch in enumerate(batches):
            self.optimizer.micro_batch(last=k == accum - 1)
            with self.site.autocast():
                loss = self.module(**step_inputs(batch, self.tier.device, counted)).loss
            (loss if packed else loss / accum).backward()
            micro.append(loss.detach().float())
        losses = torch.stack(micro)
        return float(losses.sum() if packed else losses.mean())

    def _report(self, step: int, lr: float, loss: float, norm: float, step_s: float,
                interrupted: bool) -> bool:
        """The step's ``[T]`` line, record and scalars, with every rank's peak RSS above the
        baseline; whether any rank was interrupted (then every rank saves)."""
        world, ranks, logger = self.site.world, self.site.ranks, self.reports.logger
        ram = max(0, maxrss_bytes() - self.site.baseline)
        per_rank = [[ram, self.optimizer.state_bytes(), interrupted]]
        if world is not None:
            per_rank = self.module.exchange(MEMORY_REPORT, per_rank[0])  # the plan's Exchange
        ram_ranks = [int(r[0]) for r in per_rank]
        sol = self.flops_per_step / (step_s * self.peak * ranks) if self.peak > 0 else None
        tokens_per_step, total = self.run.schedule.tokens_per_step, self.run.schedule.total
        tok_s = tokens_per_step / step_s
        tier = self.tier
        logger.print(StepLine(step=step, total=total, ms=step_s * 1e3, norm=norm, loss=loss,
                              tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                              budget=tier.rss_budget, gpu_bytes=tier.gpu_peak(),
                              gpu_budget=tier.gpu).text())
        warning = near_budget(max(ram_ranks), tier.rss_budget)
        if warning and not self.near_budget_said:  # a peak within NEAR_BUDGET of --ram
            self.near_budget_said = True
            logger.print(warning)
        logger.record("train", step=step, total=total, loss=loss, norm=norm, lr=lr,
                      ms=step_s * 1e3, tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                      ram_bytes_per_rank=ram_ranks, budget=tier.rss_budget,
                      gpu_bytes=tier.gpu_peak(), gpu_reserved_bytes=tier.gpu_reserved_peak(),
                      gpu_budget=tier.gpu, optimizer_state_bytes_per_rank=[int(r[1]) for r in per_rank],
                      tokens=step * tokens_per_step)
        if self.reports.board is not None:
            self.reports.board.scalars(step, {"train/loss": loss, "train/grad_norm": norm,
                                              "train/lr": lr, "train/tok_s": tok_s,
                                              "memory/ram_bytes": max(ram_ranks)})
        return any(r[2] for r in per_rank)

    def _evaluate(self, step: int, evals: list[torch.Tensor]) -> None:
        """The mean loss over the evaluation batches ``evals`` (split over the ranks),
        normalised over the tokens it counts (``evaluate.evaluation_loss``): a ``[V]``
        line."""
        t0 = time.perf_counter()
        model = self.built.model
        model.eval()
        world, ranks = self.site.world, self.site.ranks
        mine = evals if world is None else evals[world.rank::ranks]  # whole batches
        total_loss, count = evaluation_loss(self.module, mine, self.tier.device,
                                            self.site.autocast())
        model.train()
        if world is not None:
            per_rank = world.all_gather([total_loss, count], "evaluation loss average")
            total_loss, count = sum(r[0] for r in per_rank), sum(r[1] for r in per_rank)
        loss = total_loss / count if count else float("nan")
        ms = (time.perf_counter() - t0) * 1e3
        ppl = math.exp(min(loss, 700.0))
        self.reports.logger.print(eval_line(step=step, loss=loss, ppl=ppl, ms=ms))
        self.reports.logger.record("eval", step=step, loss=loss, ppl=ppl, ms=ms,
                                   tokens=step * self.run.schedule.tokens_per_step)
        if self.reports.board is not None:
            self.reports.board.scalars(step, {"eval/loss": loss})

    def _save(self, step: int) -> Path:
        """Checkpoint ``step`` (rank 0 writes; every rank gathers its optimizer shard). The
        weights and states of an optimizer that fit owns are read from their tiers as they
        are written, stage by stage. A run of adapters writes their adapter directory (and,
        at its last step under ``--merge``, the merged model): ``_weights``."""
        run, optimizer, model = self.run, self.optimizer, self.built.model
        main = self.site.is_main
        streamed = fit_owns_optimizer(run.opts)
        current = lambda t: t  # noqa: E731 (every weight in memory)
        if streamed:
            if not main:  # replicas: rank 0's weights and states are every rank's
                return run.out / f"step_{step}"
            from ..exec.offload import offloaded_parameters
            optimizer.settle()
            offloaded = offloaded_parameters(model)
            optimizer_state = optimizer.skeleton()
            if offloaded is not None:
                current = lambda t: offloaded.current_copy(t) if t in offloaded else t  # noqa: E731
            stream = {"materialize_optimizer": optimizer.materialize,
                      "materialize_weights": lambda name, t: current(t)}
        else:
            optimizer_state = optimizer.state_dict()  # gathered on rank 0 (every rank calls it)
            stream = {}
        if not main:
            return run.out / f"step_{step}"
        tokenizer_file, extras = travelling_files(run.opts.model, run.data)
        try:
            path = checkpoint.save_checkpoint(
                run.out, step, self._weights(step, current), tokenizer_file=tokenizer_file,
                tokenizer_extras=extras, optimizer_state=[optimizer_state], **stream,
                trainer_state={"step": step, "data": self.batches.state(), "rng": capture_rng(),
                               "identity": self.built.identity,
                               "config_hash": self.built.run_hash,
                               "options": run.opts.as_dict(), "total_steps": run.schedule.total,
                               "tokens": step * run.schedule.tokens_per_step})
        finally:
            if streamed:
                optimizer.finished_writing()  # drop the last stage's states read for it
        self.reports.logger.record("checkpoint", step=step, path=str(path))
        return path

    def _weights(self, step: int, current: Current) -> Any:
        """What ``save_checkpoint`` writes as the weights of step ``step``: the model, or a
        run of adapters' ``WeightFiles`` (``current`` reads a tensor's values now)."""
        adapters, opts = self.built.adapters, self.run.opts
        if adapters is None:
            return self.built.model
        files = adapter_weights(adapters, opts.model, current)
        if opts.merge and step == self.run.schedule.total:
            files = files + merged_weights(adapters, current)
        return files
