"""``tierflow train``: the training loop around ``tierflow.fit``.

One run: check the options (precision included), the data and the output directory (cheap,
before anything slow; the command line made these checks before importing torch, see
``preflight.py``); build or load the model and apply its precision (``model.py``); print the
header (``header.py``); plan the step with ``tierflow.fit`` (``planning.py``: gradients
accumulate in ``.grad``, the trainer's optimizer's states are ``reserve``d in the plan);
build the optimizer (``optimizer.py``); then run the steps (``steps.py``): a checkpoint's
state restored first, per optimizer step ``grad_accum`` micro-batches forward and backward under
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

The run hands records down (``run.py``): ``Run`` (its checked inputs), ``Site`` (where it
computes), ``BuiltModel`` and ``Reports``. Who steps the optimizer, and what follows from
that, are the rules of ``roles.py``: with a disk tier (``--disk DIR``) ``tierflow.fit`` owns
the optimizer (``owned.py``: updates during the backward, checkpoints streamed stage by
stage) and places the model, which is built on the disk tier or in host RAM; under torchrun
every rank then holds the whole model and its states on a disk tier of its own (a replica:
no shards), and each stage's gradients are averaged over the ranks before its update
(``TierflowModule.reduce_gradients_with``). ``--gpu`` moves the compute to CUDA or a
simulated GPU (``device.py``), where an out-of-memory error re-plans the step once
(``planning.StepPlanner.replan_after_oom``).
"""
from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import TierflowError
from ..core.units import format_bytes
from ..profile.machine import fast_bf16, run_baseline
from .device import ComputeTier
from .header import print_header
from .options import TrainOptions
from .roles import builds_on_disk, fit_owns_optimizer, ranks_hold_replicas
from .run import BuiltModel, Reports, Run, Schedule, Site

if TYPE_CHECKING:
    from ..distributed import World
    from .planning import StepPlanner


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

    from ..core.torchrun_env import world_size_from_env
    from ..distributed import join_from_env
    from ..fitting import fit  # noqa: F401  (part of the RSS baseline)
    from .checkpoint import load_checkpoint
    from .preflight import check_paths

    # the run's peaks count from here: an earlier peak of this process (the demo's tokenizer)
    # would hide them and make the baseline more than the process holds
    baseline = run_baseline()

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
    log = Path(opts.log) if opts.log else out / "log.jsonl"
    run = Run(opts, ckpt, data, out, log, Schedule.of(opts, len(data.train)))
    tier = ComputeTier.from_options(opts)

    world = join_from_env(opts.dist_timeout)
    if world is None:
        return _train_on(run, tier, None, baseline)
    try:
        code = _train_on(run, tier, world, baseline)
    except BaseException:
        world.close(finished=False)
        raise
    world.close(finished=True)
    return code


def _train_on(run: Run, tier: ComputeTier, world: World | None, baseline: int) -> int:
    """Build or load ``run``'s model on ``tier`` (every rank), onto the disk tier where
    ``roles.builds_on_disk`` says, then train it. Under a GPU with a disk tier, a model whose
    weights fit ``--ram`` is built in host RAM; if the plan then finds too little host RAM
    beside it, it is built again on the disk tier (one process only: ranks could decide
    apart). ``baseline``: the RSS after the imports."""
    from ..core.errors import BudgetError
    from ..exec.memory import return_free_memory
    from .model import count_model_parameters

    opts = run.opts
    if world is not None and run.data.train.mask is not None:
        raise TierflowError(f"--data {run.data.path} holds fine-tuning records (a loss mask), "
                            "which torchrun does not train yet (the ranks' target counts "
                            "differ); fix: train them in one process")
    precision = opts.precision(fast_bf16())
    if not fit_owns_optimizer(opts) and tier.ram is not None:
        # the trainer's model is built whole in RAM: refused first if its weights and the
        # trainable parameters' AdamW states alone pass --ram
        tier.refuse_states_beyond_ram(opts.model, count_model_parameters(run),
                                      precision.bytes_per_parameter(),
                                      world.size if world is not None else 1)
    with contextlib.ExitStack() as scratch:
        disk, on_disk = None, False
        if opts.disk:  # the disk tier: a scratch directory of this run, removed at the end
            from ..exec.disk import scratch_directory
            disk = scratch.enter_context(scratch_directory(opts.disk))
            weights = count_model_parameters(run).total * \
                int(precision.bytes_per_parameter().weights)
            on_disk = builds_on_disk(tier, weights)
        site = Site(tier, world, baseline, precision, disk)
        try:
            return _build_and_train(run, site, on_disk)
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
        return _build_and_train(run, site, on_disk=True, header_shown=True)


def _build_and_train(run: Run, site: Site, on_disk: bool, header_shown: bool = False) -> int:
    """Build the model (``on_disk``: onto the disk tier), place it, check the run's identity,
    open the run's reports and train. ``header_shown``: a first attempt printed the header
    already (it still goes to the log)."""
    from .model import build_model, run_identity

    started = time.perf_counter()
    model, adapters = build_model(run, site.precision, site.disk if on_disk else None)
    # a large model's build, profile and plan take minutes: each says its time as it ends
    if site.is_main:
        print(f"[tierflow] built the model in {time.perf_counter() - started:.1f} s", flush=True)
    if not fit_owns_optimizer(run.opts):  # the trainer steps it: whole on the compute device
        model = site.tier.place_model(model)
    elif site.tier.simulated and not on_disk:
        # into host RAM, as below a real GPU, where fit does this itself (exec/host_model)
        from ..exec.host_model import start_in_host_ram
        start_in_host_ram(model, site.tier.device)
    # else in host RAM or on disk until fit places it: under a GPU it streams from there
    identity, run_hash = run_identity(run, model, site.precision)
    with Reports.opened(run, site) as reports:
        return _run(run, site, BuiltModel(model, on_disk, identity, run_hash, adapters),
                    reports, header_shown)


def _run(run: Run, site: Site, built: BuiltModel, reports: Reports, header_shown: bool) -> int:
    """Print the header (to the log only when ``header_shown``), plan the step, build the
    optimizer, then run the steps (``steps.StepLoop``: a checkpoint's state restored first)."""
    from .planning import StepPlanner
    from .steps import StepLoop

    logger = reports.logger
    with logger.silenced() if header_shown else contextlib.nullcontext():
        peak = print_header(logger, run, site, built.model)
    planner = StepPlanner.for_run(run, site, built, logger)
    module = planner.plan(site.tier)
    logger.keep()  # planned: this run's log replaces an earlier run's in its place
    optimizer = _optimizer(planner, module)
    planner.report(module)
    return StepLoop(run, site, built, reports, planner, module, optimizer, peak).run_steps()


def _optimizer(planner: StepPlanner, module: Any) -> Any:
    """The optimizer the steps use, with ``optimizer.LocalOptimizer``'s interface: the
    per-stage optimizers of the planned ``module`` when fit owns them
    (``roles.fit_owns_optimizer``), else the trainer's, over every parameter in one process
    or as ZeRO-2 shards under torchrun. Under torchrun the module's plan gains each stage's
    reduction over the ranks (``plan/reductions.py``, priced at the bus bandwidth measured
    here): replicas (``roles.ranks_hold_replicas``) average each stage's gradients before
    its update, ZeRO-2 reduce-scatters them; and the values the ranks exchange each step
    (``step_values``), which the step runs as the plan's Exchange ops."""
    import torch

    from ..distributed import ShardedOptimizer
    from ..plan.reductions import Reductions, step_values
    from ..profile.machine import bus_bandwidth
    from .optimizer import LocalOptimizer, build_optimizer, param_groups
    from .owned import FitOwnedOptimizer

    opts, world, precision = planner.opts, planner.site.world, planner.site.precision
    params = list(planner.built.model.parameters())
    optimizer: Any
    if fit_owns_optimizer(opts):
        optimizer = FitOwnedOptimizer(module, params, opts, planner.rounding)
    elif world is None:
        optimizer = LocalOptimizer(build_optimizer(param_groups(params, opts), opts, precision),
                                   params)
    else:
        optimizer = ShardedOptimizer(world, [list(stage.parameters())
                                             for stage in module.chain.stages],
                                     param_groups(params, opts),
                                     lambda shard: build_optimizer(shard, opts, precision),
                                     module.exchange)
    if world is not None:
        replicas = ranks_hold_replicas(opts)
        reductions = Reductions(world.size, all_reduce=replicas,
                                bus=bus_bandwidth(world, torch.device("cpu")),
                                exchanged=step_values(all_reduce=replicas))
        if replicas:
            module.reduce_gradients_with(world.average, reductions, world.all_gather)
        else:
            module.run_collectives_with(optimizer, reductions)
    return optimizer
