"""``tierflow train``: the training loop around ``tierflow.fit``.

One run: check the options (precision included), the data and the output directory (cheap,
before anything slow; the command line made these checks before importing torch, see
``preflight.py``); build or load the model and apply its precision (``model.py``); print the
header (``header.py``); plan the step with ``tierflow.fit`` (``planning.py``: gradients
accumulate in ``.grad``, the optimizer's states are ``reserve``d in the plan); build the
optimizer (``optimizer.py``) and restore a checkpoint's state; then run the steps
(``steps.py``): per optimizer step ``grad_accum`` micro-batches forward and backward under
``autocast_context``, global-norm clipping, AdamW with the warmup + cosine schedule, one
``[T]`` line and one JSON record; ``[V]`` evaluations every ``--eval-every`` steps;
checkpoints every ``--save-every`` steps, at the end and on Ctrl-C.

Resuming restores the weights, the AdamW state (fp32 master, 8-bit moments and the
stochastic-rounding generator included), the data stream position and every RNG, so the
resumed steps are bit-identical to an uninterrupted run's in every precision.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank runs this loop on its rows of each global
batch (``tierflow.distributed``): gradients are reduce-scattered stage by stage during
backward, the optimizer updates this rank's shard (ZeRO-2) and the parameters are
all-gathered; rank 0 prints, logs and writes checkpoints in the single-process format. The
optimizer is built in ``optimizer.build_optimizer`` alone, for one process and for the
shards alike.

With ``--disk DIR`` the model lives on a disk tier and ``tierflow.fit`` owns the optimizer
(``owned.py``: updates during the backward, checkpoints streamed stage by stage); under
torchrun every rank then holds the whole model and its states on a disk tier of its own
(a replica: no shards), and each stage's gradients are averaged over the ranks before its
update (``TierflowModule.reduce_gradients_with``); ``--gpu``
moves the compute to CUDA or a simulated GPU (``device.py``), where an out-of-memory error
re-plans the step once (``planning.StepPlanner.replan_after_oom``).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
from pathlib import Path
from typing import Any

from ..errors import TierflowError
from ..profile.machine import fast_bf16, maxrss_bytes, reset_peak_rss
from ..seeding import derived_seed
from ..units import format_bytes
from .data_dir import DataDir
from .device import ComputeTier
from .header import print_header
from .options import TrainOptions
from .sol import model_flops_per_token

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

    # transformers' model code, as the peers import it before their baseline: its first
    # import (which brings torch's compiler stack) takes about 120 MiB, and the lazy
    # ``from transformers import AutoModelForCausalLM`` does not make it
    import transformers.modeling_utils  # noqa: F401  (part of the RSS baseline)

    from .. import api  # noqa: F401  (part of the RSS baseline)
    from ..distributed import join_from_env
    from ..torchrun_env import world_size_from_env
    from .checkpoint import load_checkpoint
    from .preflight import check_paths

    # the run's peaks count from here: an earlier peak of this process (the demo's tokenizer)
    # would hide them and make the baseline more than the process holds
    reset_peak_rss()
    baseline = maxrss_bytes()

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
    data = check_paths(opts, create=True)
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
    rank). Under a GPU with ``--disk``, a model whose weights fit ``--ram`` is built in host
    RAM; if the plan then finds too little host RAM beside it, it is built again on the disk
    tier (one process only: ranks could decide apart)."""
    from ..errors import BudgetError
    from ..exec.memory import return_free_memory
    from .model import count_model_parameters

    # --- the model, with its precision, and the run it belongs to
    precision = opts.precision(fast_bf16())
    if not opts.disk and tier.ram is not None:  # built whole in RAM: refused first if its
        # weights and the trainable parameters' AdamW states alone pass --ram
        tier.refuse_states_beyond_ram(opts.model, count_model_parameters(opts, ckpt, data),
                                      precision.bytes_per_parameter(),
                                      world.size if world is not None else 1)
    with contextlib.ExitStack() as scratch:
        disk = None
        if opts.disk:  # the disk tier: a scratch directory of this run, removed at the end
            from ..exec.disk import scratch_directory
            disk = scratch.enter_context(scratch_directory(opts.disk))
            weights = count_model_parameters(opts, ckpt, data).total * \
                int(precision.bytes_per_parameter().weights)
        # on disk without a GPU, and under one when host RAM could not hold the weights
        on_disk = disk is not None and (
            tier.gpu is None or (tier.ram is not None and weights > tier.ram))
        try:
            return _build_and_train(opts, ckpt, data, out, log_path, tier, world, baseline,
                                    precision, disk, on_disk)
        except BudgetError as error:
            if on_disk or disk is None or error.tier != "ram" or world is not None:
                raise
            needed = error.smallest
        gc.collect()  # the model built in host RAM goes before the next one is built,
        return_free_memory()  # and its memory back to the OS (the budget counts the RSS)
        print(f"note: the model's weights ({format_bytes(weights)}) fit --ram "
              f"{format_bytes(tier.ram)}, but a step with them there needs "
              f"{format_bytes(needed)} of it: building the model on the disk tier "
              f"({opts.disk}) instead", flush=True)
        return _build_and_train(opts, ckpt, data, out, log_path, tier, world, baseline,
                                precision, disk, True, header_shown=True)


def _build_and_train(opts: TrainOptions, ckpt, data: DataDir, out: Path, log_path: Path,
                     tier: ComputeTier, world, baseline: int, precision, disk: Path | None,
                     on_disk: bool, header_shown: bool = False) -> int:
    """Build the model (``on_disk``: onto the disk tier in ``disk``) and train it.
    ``header_shown``: a first attempt printed the header already (it still goes to the log)."""
    from .model import build_model

    model = build_model(opts, ckpt, data, precision, disk if on_disk else None)
    if not opts.disk:
        model = tier.place_model(model)
    elif tier.simulated and not on_disk:
        # into host RAM, as below a real GPU, where fit does this itself (exec/host_model)
        from ..exec.host_model import start_in_host_ram
        start_in_host_ram(model, tier.device)
    # else in host RAM or on disk until fit places it: under a GPU it streams from there
    return _train_model(opts, ckpt, data, out, log_path, tier, world, baseline, precision,
                        model, None if on_disk else disk, header_shown)


def _train_model(opts: TrainOptions, ckpt, data: DataDir, out: Path, log_path: Path,
                 tier: ComputeTier, world, baseline: int, precision, model,
                 disk: Path | None, header_shown: bool = False) -> int:
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
                    tokens_per_step=tokens_per_step, baseline=baseline, world=world, disk=disk,
                    header_shown=header_shown)
    finally:
        if board is not None:
            board.close()
        logger.close()


def _run(*, opts: TrainOptions, data: DataDir, out: Path, logger, tier: ComputeTier, board,
         precision, model, identity: dict, run_hash: str, ckpt, total: int, warmup: int,
         min_lr: float, tokens_per_step: int, baseline: int, world, disk: Path | None,
         header_shown: bool = False) -> int:
    """Print the header (to the log only when ``header_shown``), plan the step, build the
    optimizer, restore a checkpoint's state, then run the steps (``steps.StepLoop``)."""
    import torch

    from ..distributed import ShardedOptimizer
    from ..exec.memory import configure_host_allocator
    from ..precision import autocast_context
    from .codec import restore_rng
    from .data import Batches, eval_batches
    from .optimizer import (
        LocalOptimizer,
        build_optimizer,
        param_groups,
        reserved_bytes,
        step_transient_bytes,
    )
    from .owned import FitOwnedOptimizer, RoundingStreams
    from .packing import PackedBatches, packed_eval_batches, planning_sample
    from .planning import StepPlanner, fit_config, report_plan
    from .steps import StepLoop

    with logger.silenced() if header_shown else contextlib.nullcontext():
        peak = print_header(logger, opts=opts, precision=precision, tier=tier, world=world,
                            data=data, model=model, total=total, warmup=warmup,
                            min_lr=min_lr, out=out, tokens_per_step=tokens_per_step,
                            baseline=baseline)

    # [Plan]: per rank (budgets are per rank; each rank runs batch-size / ranks rows)
    ranks = world.size if world is not None else 1
    autocast = functools.partial(autocast_context, precision, tier.device.type)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if tier.ram is not None and not opts.disk:
        # as fit will under a RAM budget: freed memory leaves the RSS at once, so the
        # optimizer step's temporaries are measured below as fresh memory (malloc's dynamic
        # threshold would otherwise count heap growth: 25 MB for a 4 MB parameter's step)
        configure_host_allocator()
    # on the GPU: a model still in host RAM (--disk) is placed there by fit, never whole
    packed = data.train.mask is not None  # fine-tuning data: packed rows, masked loss
    if packed and world is not None:
        raise TierflowError(f"--data {data.path} holds fine-tuning records (a loss mask), which "
                            f"torchrun does not train yet (the ranks' target counts differ); "
                            f"fix: train them in one process")
    sample = planning_sample(opts.batch_size // ranks, opts.seq_len, packed, tier.device)
    planner = StepPlanner(
        opts, model, sample,
        config=fit_config(opts, tier), precision=precision,
        # with --disk, the per-stage optimizers' stochastic-rounding streams (owned.py)
        rounding=RoundingStreams.seeded(tier.device, opts.seed, model),
        reserve=-(-reserved_bytes(trainable, precision) // ranks),  # this rank's shard
        step_temporaries=0 if opts.disk else step_transient_bytes(trainable, opts, precision,
                                                                  tier.device),
        disk=disk, baseline=baseline, logger=logger, autocast=autocast)
    module = planner.plan(tier)
    logger.keep()  # planned: this run's log replaces an earlier run's in its place
    report_plan(module, opts=opts, precision=precision, tier=tier, world=world,
                trainable=trainable, step_temporaries=planner.step_temporaries, logger=logger)

    groups = param_groups(params, opts)
    if opts.disk:
        optimizer: Any = FitOwnedOptimizer(module, params, opts, planner.rounding)
        if world is not None:  # replicas: each stage's gradients averaged before its update
            module.reduce_gradients_with(world.average)
    elif world is None:
        optimizer = LocalOptimizer(build_optimizer(groups, opts, precision), params)
    else:
        optimizer = ShardedOptimizer(world, [list(stage.parameters())
                                             for stage in module.chain.stages],
                                     groups, lambda shard: build_optimizer(shard, opts, precision))
    kind = PackedBatches if packed else Batches
    batches = kind(data.train, opts.seq_len, opts.batch_size, opts.seed,
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
        evals = (packed_eval_batches if packed else eval_batches)(
            data.eval, opts.seq_len, opts.batch_size, opts.eval_steps)
        if not evals:
            logger.print(f"note: eval.bin holds {len(data.eval)} tokens, less than one window of "
                         f"{opts.seq_len + 1}: evaluation is off")
    steps = StepLoop(opts=opts, model=model, module=module, optimizer=optimizer,
                     planner=planner, tier=tier, batches=batches, evals=evals, data=data,
                     out=out, logger=logger, board=board, world=world, autocast=autocast,
                     identity=identity, run_hash=run_hash, total=total, warmup=warmup,
                     min_lr=min_lr, tokens_per_step=tokens_per_step, baseline=baseline,
                     flops_per_step=model_flops_per_token(model, opts.seq_len)
                     * tokens_per_step, peak=peak)
    return steps.run(start)
