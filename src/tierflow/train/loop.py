"""``tierflow train``: the training loop around ``tierflow.fit``.

One run: check the options (precision included), the data and the output directory (cheap,
before anything slow); build or load the model and apply its precision (``model.py``); plan
the step with ``tierflow.fit`` (gradients accumulate in ``.grad``, the optimizer's states are
``reserve``d in the plan); then per optimizer step: ``grad_accum`` micro-batches forward and
backward under ``autocast_context``, global-norm clipping, AdamW (``optimizer.py``) with the
warmup + cosine schedule, one ``[T]`` line and one JSON record. ``[V]`` evaluations every
``--eval-every`` steps; checkpoints every ``--save-every`` steps, at the end and on Ctrl-C.

Resuming restores the weights, the AdamW state (fp32 master, 8-bit moments and the
stochastic-rounding generator included), the data stream position and every RNG, so the
resumed steps are bit-identical to an uninterrupted run's in every precision.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank runs this loop on its rows of each global
batch (``tierflow.dist``): gradients are reduce-scattered stage by stage during backward,
the optimizer updates this rank's shard (ZeRO-2) and the parameters are all-gathered; rank 0
prints, logs and writes checkpoints in the single-process format. The optimizer is built in
``optimizer.build_optimizer`` alone, for one process and for the shards alike.

With ``--disk DIR`` the model lives on a disk tier and ``tierflow.fit`` owns the optimizer
(``owned.py``: updates during the backward, checkpoints streamed stage by stage); ``--gpu``
moves the compute to CUDA or a simulated GPU (``device.py``), where an out-of-memory error
re-plans the step once. ``header.py`` prints the sections before the first step and
``guards.py`` wraps the step loop (Ctrl-C, ``--trace``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import time
from pathlib import Path
from typing import Any

from ..errors import BudgetError, TierflowError
from ..seeding import derived_seed
from ..units import format_bytes
from .data_dir import DataDir
from .device import ComputeTier
from .guards import Interrupt, traced
from .header import print_header
from .options import RECOMPUTE, TrainOptions
from .sol import model_flops_per_token

INTERRUPTED = 130
DEFAULT_STEPS = 100


# ---------------------------------------------------------------- the run

def train(opts: TrainOptions) -> int:
    """Run ``tierflow train`` with validated ``opts``; returns the exit code. Under torchrun
    (``WORLD_SIZE`` > 1) every rank runs this, in the default process group."""
    try:
        return _train(opts)
    except PermissionError as e:  # a file or directory the user may not read or write
        name = e.filename or "a file"
        raise TierflowError(f"cannot read {name} (permission denied): check its permissions "
                            "or copy it somewhere you can read") from None


def _train(opts: TrainOptions) -> int:
    import torch  # noqa: F401  (part of the RSS baseline)
    from transformers import AutoModelForCausalLM  # noqa: F401  (part of the RSS baseline)

    from .. import api, measure  # noqa: F401  (api: part of the RSS baseline)
    from ..dist import join_from_env
    from ..torchrun_env import world_size_from_env
    from .checkpoint import load_checkpoint
    from .preflight import check_paths

    # the run's peaks count from here: an earlier peak of this process (the demo's tokenizer)
    # would hide them and make the baseline more than the process holds
    measure.reset_peak_rss()
    baseline = measure.maxrss_bytes()

    # --- everything cheap first (the command line's preflight made these checks already,
    # unless the run resumes): resume state, options, data, output directories
    ckpt = load_checkpoint(opts.resume) if opts.resume else None
    if ckpt is not None:
        saved_opts = ckpt.trainer_state.get("options")
        if isinstance(saved_opts, dict):
            opts.inherit(saved_opts)
    opts.validate(world_size_from_env())
    out = Path(opts.out) if opts.out else (ckpt.path.parent if ckpt is not None else Path("out"))
    opts.out = str(out)
    data = check_paths(opts)
    log_path = Path(opts.log) if opts.log else out / "log.jsonl"
    tier = ComputeTier.from_options(opts)

    world = join_from_env(opts.dist_timeout)
    if world is None:
        return _train_in_world(opts, ckpt, data, out, log_path, tier, None, baseline)
    try:
        code = _train_in_world(opts, ckpt, data, out, log_path, tier, world, baseline)
    except BaseException:
        world.close(finished=False)
        raise
    world.close(finished=True)
    return code


def _train_in_world(opts: TrainOptions, ckpt, data: DataDir, out: Path, log_path: Path,
                    tier: ComputeTier, world, baseline: int) -> int:
    """Build or load the model (onto the disk tier with ``--disk``), then train it (every
    rank)."""
    from .. import measure
    from .model import build_model

    # --- the model, with its precision, and the run it belongs to
    precision = opts.precision(measure.fast_bf16())
    with contextlib.ExitStack() as scratch:
        offload, disk = None, None
        if opts.disk:  # the disk tier: a scratch directory of this run, removed at the end
            from ..exec.disk import DiskStore, scratch_directory
            from ..exec.offload import OffloadedParameters
            disk = scratch.enter_context(scratch_directory(opts.disk))
            if tier.gpu is None:  # the model is built onto it
                offload = OffloadedParameters(DiskStore(disk), dtype=precision.parameter_dtype)
        model = build_model(opts, ckpt, data, precision, offload)
        if not opts.disk:
            model = tier.place_model(model)
        elif tier.simulated:  # as below a real GPU, whose fit does this itself (exec/host_model)
            from ..exec.host_model import start_in_host_ram
            start_in_host_ram(model, tier.device)
        # else in host RAM (or on disk) until fit places it: under a GPU it streams from there
        return _train_model(opts, ckpt, data, out, log_path, tier, world, baseline,
                            precision, model, disk if offload is None else None)


def _train_model(opts: TrainOptions, ckpt, data: DataDir, out: Path, log_path: Path,
                 tier: ComputeTier, world, baseline: int, precision, model,
                 disk: Path | None) -> int:
    """Check the run's identity, open the logs, then ``_run``. ``disk``: the disk tier's
    directory when the model was not built onto it (under a GPU)."""
    from .logger import Logger
    from .model import run_identity

    identity, run_hash = run_identity(opts, ckpt, data, model, precision)

    tokens_per_step = opts.batch_size * opts.grad_accum * opts.seq_len
    if opts.steps is not None:
        total = opts.steps
    elif opts.epochs is not None:
        total = max(1, math.ceil(opts.epochs * len(data.train) / tokens_per_step))
    else:
        total = DEFAULT_STEPS
    warmup = opts.warmup if opts.warmup is not None else (total * 5) // 100
    min_lr = opts.min_lr if opts.min_lr is not None else opts.lr / 10

    main = world is None or world.is_main
    logger = Logger(log_path, append=ckpt is not None, active=main)
    board = None
    try:
        if opts.tensorboard and main:
            from .tensorboard import EventWriter
            board = EventWriter(opts.tensorboard)
        return _run(opts=opts, data=data, out=out, logger=logger, tier=tier, board=board,
                    precision=precision, model=model, identity=identity, run_hash=run_hash,
                    ckpt=ckpt, total=total, warmup=warmup, min_lr=min_lr,
                    tokens_per_step=tokens_per_step, baseline=baseline, world=world, disk=disk)
    finally:
        if board is not None:
            board.close()
        logger.close()


def _run(*, opts: TrainOptions, data: DataDir, out: Path, logger, tier: ComputeTier, board,
         precision, model, identity: dict, run_hash: str, ckpt, total: int, warmup: int,
         min_lr: float, tokens_per_step: int, baseline: int, world, disk: Path | None) -> int:
    import torch

    from .. import measure
    from ..api import fit
    from ..config import FitConfig
    from ..dist import ShardedOptimizer, bus_bandwidth, step_seconds
    from ..exec.offload import offloaded_parameters
    from ..plan.choose import make_plan
    from ..precision import autocast_context
    from ..precision.rounding import generator_for
    from .checkpoint import latest_checkpoint, save_checkpoint
    from .codec import capture_rng, restore_rng
    from .data import Batches, eval_batches
    from .logger import PlanPrecision, eval_line, plan_section, train_line
    from .optimizer import LocalOptimizer, build_optimizer, param_groups, reserved_bytes
    from .owned import FitOwnedOptimizer
    from .schedule import lr_at

    peak = print_header(logger, opts=opts, precision=precision, tier=tier, world=world,
                        data=data, model=model, total=total, warmup=warmup, min_lr=min_lr,
                        out=out, tokens_per_step=tokens_per_step, baseline=baseline)

    # [Plan]: per rank (budgets are per rank; each rank runs batch-size / ranks rows)
    ranks = world.size if world is not None else 1
    main = world is None or world.is_main
    autocast = functools.partial(autocast_context, precision, tier.device.type)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    reserve = -(-reserved_bytes(trainable, precision) // ranks)  # this rank's shard
    # on the GPU: a model still in host RAM (--disk) is placed there by fit, never whole
    sample_batch = torch.zeros(opts.batch_size // ranks, opts.seq_len + 1, dtype=torch.long,
                               device=tier.device)
    sample = {"input_ids": sample_batch[:, :-1], "shift_labels": sample_batch[:, 1:]}
    # every stage's optimizer rounds with one generator on the compute device (the
    # checkpoint's one generator): a stage stepped in host RAM would need a CPU one
    on_host = opts.host_updates
    if precision.rounds_stochastically and tier.device.type != "cpu":
        if on_host == "all":
            raise TierflowError("--host-updates all steps AdamW on the CPU, but this run's "
                                "AdamW rounds stochastically with one generator on the GPU "
                                "(bf16 moments, or bf16 weights without a master): use "
                                "--host-updates auto, or --optim-dtype fp32 and --master fp32")
        on_host = "never"
    config = FitConfig(planner=RECOMPUTE[opts.recompute], compile=opts.compile,
                       stream=opts.stream, prefetch_depth=opts.prefetch,
                       serial_reads=opts.serial_reads,
                       simulated_gpu=tier.simulated, host_updates=on_host)
    groups = param_groups(params, opts)
    # with --disk, the per-stage optimizers' one stochastic-rounding stream (see owned.py)
    rounding = generator_for(tier.device, opts.seed)

    def plan_step(tier: ComputeTier):
        """``tierflow.fit`` under ``tier``'s budgets (again after a GPU out-of-memory), less
        what the process already holds of --ram."""
        held = tier.held_outside_the_plan(model, baseline)
        if held:
            logger.print(f"{format_bytes(held)} of --ram is held before planning (the data, "
                         f"the model's objects): the plan gets the rest")
        try:
            with torch.random.fork_rng(devices=[]), autocast():
                if opts.disk:  # tierflow owns the optimizer: weights and states may be on disk
                    fitted = fit(model, sample, **tier.fit_budgets(held), config=config, disk=disk,
                                 optimizer=lambda ps: build_optimizer(
                                     param_groups(list(ps), opts), opts, precision, rounding),
                                 grad_accum=opts.grad_accum,
                                 max_grad_norm=opts.clip if opts.clip > 0 else None)
                    rounding.manual_seed(opts.seed)  # the optimizer probe drew from it
                    return fitted
                return fit(model, sample, **tier.fit_budgets(held), reserve=reserve,
                           grad_accum=opts.grad_accum, config=config)
        except BudgetError as e:
            error = tier.over_budget(e, held)
            raise (error if opts.disk else tier.suggest_lower_tiers(error)) from None

    module = plan_step(tier)
    grads = sum(p.nbytes for p in trainable)
    if opts.disk:  # each stage's gradients are freed by its update: one stage's at a time
        grads = max((sum(p.nbytes for p in ps) for ps in module.optimizer.stage_params),
                    default=0)
    dist_figures = None
    if world is not None:
        bus = bus_bandwidth(world, torch.device("cpu"))
        dist_figures = {"world_size": ranks, "backend": world.backend, "bus_bandwidth": bus,
                        "comm_bytes": 2 * grads,  # gradients reduced, parameters gathered
                        "predicted_comm_s": step_seconds(ranks, grads, grads, bus)}
    per = precision.bytes_per_parameter()
    table, fields = plan_section(
        module.plan, grads=grads, budget=tier.plan_budget, grad_accum=opts.grad_accum,
        dist=dist_figures,
        precision=PlanPrecision(per, trainable=sum(p.numel() for p in trainable),
                                master=int(per.master * sum(p.numel() for p in trainable)) // ranks,
                                dtypes=precision.to_dict()),
        update_pass=module.update_pass)
    logger.print()
    logger.print(table)
    logger.print(module.plan.explain())
    logger.record("plan", **fields)

    if opts.disk:
        optimizer: Any = FitOwnedOptimizer(module, params, opts)
    elif world is None:
        optimizer = LocalOptimizer(build_optimizer(groups, opts, precision), params)
    else:
        optimizer = ShardedOptimizer(world, [list(stage.parameters())
                                             for stage in module.chain.stages],
                                     groups, lambda shard: build_optimizer(shard, opts, precision))
    batches = Batches(data.train, opts.seq_len, opts.batch_size, opts.seed,
                      part=(world.rank, ranks) if world is not None else (0, 1))
    start = 0
    if ckpt is not None:
        state = ckpt.trainer_state
        if opts.disk:  # stage by stage, straight to the disk tier
            optimizer.load_checkpoint(ckpt)
        elif ckpt.optimizer is not None:
            optimizer.load_state_dict(ckpt.optimizer_state[0])
        batches.index = int(state["data"]["index"])
        restore_rng(state["rng"])
        start = ckpt.step
        logger.print(f"\nresumed from {ckpt.path} at step {start}")
        logger.record("resume", path=str(ckpt.path), step=start)
    else:
        torch.manual_seed(opts.seed)
    if world is not None and world.rank > 0:  # its own dropout masks, not rank 0's
        torch.manual_seed(derived_seed(opts.seed, "rank", world.rank, "step", start))
    evals = []
    if opts.eval_every and data.eval is not None:
        evals = eval_batches(data.eval, opts.seq_len, opts.batch_size, opts.eval_steps)
        if not evals:
            logger.print(f"note: eval.bin holds {len(data.eval)} tokens, less than one window of "
                         f"{opts.seq_len + 1}: evaluation is off")

    flops_per_step = model_flops_per_token(model, opts.seq_len) * tokens_per_step

    def save(step: int) -> Path:
        if opts.disk:  # weights and states read from the disk tier as they are written
            optimizer.settle()
            offloaded = offloaded_parameters(model)
            optimizer_state = optimizer.skeleton()
            stream = {"materialize_optimizer": optimizer.materialize,
                      "materialize_weights": lambda name, t: offloaded.current_copy(t)
                      if t in offloaded else t}
        else:
            optimizer_state = optimizer.state_dict()  # gathered on rank 0 (every rank calls it)
            stream = {}
        if not main:
            return out / f"step_{step}"
        try:
            path = save_checkpoint(out, step, model, tokenizer_file=data.tokenizer_file,
                                   optimizer_state=[optimizer_state], **stream,
                                   trainer_state={"step": step, "data": batches.state(),
                                                  "rng": capture_rng(), "identity": identity,
                                                  "config_hash": run_hash,
                                                  "options": opts.as_dict(), "total_steps": total,
                                                  "tokens": step * tokens_per_step})
        finally:
            if opts.disk:
                optimizer.finished_writing()  # drop the last stage's states read for it
        logger.record("checkpoint", step=step, path=str(path))
        return path

    def evaluate(step: int) -> None:
        t0 = time.perf_counter()
        model.eval()
        mine = evals if world is None else evals[world.rank::ranks]  # whole batches per rank
        with torch.no_grad(), autocast():
            losses = [float(module(input_ids=b[:, :-1], shift_labels=b[:, 1:]).loss)
                      for b in (b.to(tier.device) for b in mine)]
        model.train()
        total_loss, count = sum(losses), len(losses)
        if world is not None:
            per_rank = world.all_gather([total_loss, count], "evaluation loss average")
            total_loss, count = sum(r[0] for r in per_rank), sum(r[1] for r in per_rank)
        loss = total_loss / count
        ms = (time.perf_counter() - t0) * 1e3
        ppl = math.exp(min(loss, 700.0))
        logger.print(eval_line(step=step, loss=loss, ppl=ppl, ms=ms))
        logger.record("eval", step=step, loss=loss, ppl=ppl, ms=ms, tokens=step * tokens_per_step)
        if board is not None:
            board.scalars(step, {"eval/loss": loss})

    def forward_backward() -> float:
        """One step's micro-batches, forward and backward; their mean loss."""
        micro = []
        for k in range(opts.grad_accum):
            optimizer.micro_batch(last=k == opts.grad_accum - 1)
            batch = batches.next().to(tier.device)
            with autocast():
                loss = module(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
            (loss / opts.grad_accum).backward()
            micro.append(loss.detach().float())
        return float(torch.stack(micro).mean())

    def replan_after_oom(step: int) -> None:
        """Plan the step again under 80% of the predicted peak that did not fit (or, when no
        plan fits that, under the least budget that works, if that is below the peak). The
        plan is made from the costs already measured: measuring the stages again would need
        GPU memory that just ran out."""
        nonlocal module, tier
        was, peak, costs = tier.gpu, module.plan.predicted_peak, module.plan.costs
        tier = dataclasses.replace(tier, gpu=int(0.8 * min(was, peak)))
        try:
            plan = make_plan(costs, tier.gpu, config, tier="gpu")
        except BudgetError as e:
            plan = None
            if e.smallest < peak:
                tier = dataclasses.replace(tier, gpu=e.smallest)
                with contextlib.suppress(BudgetError):  # rotor's rounded table may need more
                    plan = make_plan(costs, tier.gpu, config, tier="gpu")
            if plan is None:
                raise TierflowError(f"the GPU ran out of memory at step {step} and no plan "
                                    f"needs less than the {format_bytes(peak)} that did not fit "
                                    "(the least that works is "
                                    f"{format_bytes(e.smallest)}): give a smaller --batch-size "
                                    "or --seq-len, or free the GPU") from None
        module = module.with_plan(plan)
        optimizer.zero_grad()
        if tier.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        logger.print(f"the GPU ran out of memory at step {step}: re-planned under "
                     f"{format_bytes(tier.gpu)} (was {format_bytes(was)}, predicted peak "
                     f"{format_bytes(peak)}): {module.plan.strategy}, predicted peak "
                     f"{format_bytes(module.plan.predicted_peak)}; retrying the step once")
        logger.record("replan", step=step, gpu_budget=tier.gpu, previous_budget=was,
                      predicted_peak=module.plan.predicted_peak, strategy=module.plan.strategy)

    if start >= total:
        logger.print(f"\nthe checkpoint is at step {start}, the run has {total} steps: nothing "
                     "to do (raise --steps to train further)")
        return 0
    logger.print()
    last_saved = start if ckpt is not None else None
    step = start
    step_s = 0.0
    with Interrupt() as interrupt, traced(opts.trace, logger):
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            if world is not None:
                world.step = step
            lr = lr_at(step - 1, lr=opts.lr, warmup=warmup, total=total, min_lr=min_lr)
            optimizer.set_lr(lr)
            retry = tier.gpu is not None and not opts.disk  # a GPU plan of ours to shrink
            position, rng = batches.index, capture_rng() if retry else None
            try:
                loss_value = forward_backward()
            except torch.OutOfMemoryError:
                if not retry:
                    raise
                loss_value = None  # re-planned below, once the handler has let the error go
            if loss_value is None:
                replan_after_oom(step)
                batches.index = position
                restore_rng(rng)
                try:
                    loss_value = forward_backward()
                except torch.OutOfMemoryError:
                    raise TierflowError(
                        f"the GPU ran out of memory again at step {step}, under the re-planned "
                        f"budget of {format_bytes(tier.gpu)}: give a smaller --gpu (what else "
                        "uses the GPU is not in the budget) or a smaller --batch-size") from None
            if world is not None:  # the ranks' means of equal row counts: the global mean
                means = world.all_gather([loss_value], "loss average")
                loss_value = sum(r[0] for r in means) / ranks
            norm_value = optimizer.clip_grad_norm(opts.clip if opts.clip > 0 else math.inf)
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                what = (f"loss is {loss_value}" if not math.isfinite(loss_value)
                        else f"gradient norm is {norm_value}")
                logger.record("error", step=step, loss=loss_value, norm=norm_value)
                good = latest_checkpoint(out)
                raise TierflowError(f"the {what} at step {step}: training stopped, nothing saved "
                                    f"for this step; the last good checkpoint is "
                                    f"{good if good else 'none (no checkpoint was written)'}; fix: "
                                    "lower --lr, raise --warmup or set --clip")
            optimizer.step()
            step_s = time.perf_counter() - t0
            ram = max(0, measure.maxrss_bytes() - baseline)
            per_rank = [[ram, optimizer.state_bytes(), interrupt.requested]]
            if world is not None:
                per_rank = world.all_gather(per_rank[0], "memory report")
            ram_ranks = [int(r[0]) for r in per_rank]
            stop = any(r[2] for r in per_rank)  # every rank saves, or none
            sol = flops_per_step / (step_s * peak * ranks) if peak > 0 else None
            tok_s = tokens_per_step / step_s
            logger.print(train_line(step=step, total=total, ms=step_s * 1e3, norm=norm_value,
                                    loss=loss_value, tok_s=tok_s, sol=sol,
                                    ram_bytes=max(ram_ranks), budget=tier.rss_budget,
                                    gpu_bytes=tier.gpu_peak(), gpu_budget=tier.gpu))
            logger.record("train", step=step, total=total, loss=loss_value, norm=norm_value, lr=lr,
                          ms=step_s * 1e3, tok_s=tok_s, sol=sol, ram_bytes=max(ram_ranks),
                          ram_bytes_per_rank=ram_ranks, budget=tier.rss_budget,
                          gpu_bytes=tier.gpu_peak(), gpu_budget=tier.gpu,
                          optimizer_state_bytes_per_rank=[int(r[1]) for r in per_rank],
                          tokens=step * tokens_per_step)
            if board is not None:
                board.scalars(step, {"train/loss": loss_value, "train/grad_norm": norm_value,
                                     "train/lr": lr, "train/tok_s": tok_s,
                                     "memory/ram_bytes": max(ram_ranks)})
            if evals and opts.eval_every and step % opts.eval_every == 0:
                evaluate(step)
            if opts.save_every and step % opts.save_every == 0 and step != total:
                save(step)
                last_saved = step
            if stop and step != total:
                path = save(step)
                logger.print(f"interrupted: saved step {step} to {path}; continue with "
                             f"--resume {path}")
                logger.record("interrupted", step=step, path=str(path))
                return INTERRUPTED
            logger.bar(step, total, step_s)
    if evals and opts.eval_every and total % opts.eval_every != 0:
        evaluate(total)
    path = save(total) if last_saved != total else out / f"step_{total}"
    if world is not None:
        world.barrier("end of the run")  # rank 0 has written the last checkpoint
    logger.print(f"done: {total} steps; saved {path}")
    logger.record("done", step=total, path=str(path))
    return 0
