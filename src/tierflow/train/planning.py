"""How ``tierflow train`` plans its step: ``tierflow.fit`` under the compute tier's budgets,
less what the process already holds (``StepPlanner.plan``); again under a smaller GPU budget
after an out-of-memory error, from the costs already measured (``StepPlanner.replan_after_oom``);
and the ``[Plan]`` section that shows the plan (``StepPlanner.report``).

When fit owns the optimizer (``roles.fit_owns_optimizer``: a run with a disk tier) the plan
places the weights, the gradients and the optimizer's states on the tiers; when the trainer
steps its own, the optimizer's states and its step's temporaries are ``reserve``d in the
plan's budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from typing import Any

import torch

from ..core.config import FitConfig
from ..core.errors import BudgetError, TierflowError
from ..core.units import format_bytes
from ..exec import enforce
from ..fitting import fit
from ..models.freeze import tied_frozen
from ..plan.ops import COLLECTIVES, Exchange
from ..profile.kept_profiles import RunShape, keep_profile
from ..sim.shapes import shape_from_config
from .device import ComputeTier
from .logger import Logger, PlanPrecision, plan_section
from .optimizer import (
    build_optimizer,
    param_groups,
    reserved_bytes,
    step_transient_bytes,
)
from .options import RECOMPUTE, TrainOptions
from .owned import RoundingStreams
from .packing import planning_sample
from .roles import fit_owns_optimizer, ranks_hold_replicas
from .run import BuiltModel, Run, Site

# of the RAM the plan gets when the trainer steps its own optimizer, kept free for what a plan
# cannot predict: the measured peak of llama-20m runs that filled --ram 500MiB and 600MiB came
# out up to 5.7 MiB (1%) above their prediction (benchmarks/ram_budget.py)
RAM_HEADROOM = 0.02


def fit_config(opts: TrainOptions, tier: ComputeTier) -> FitConfig:
    """The ``FitConfig`` of the run's flags. A plan of the CPU under --ram in which the
    trainer steps its own optimizer keeps ``RAM_HEADROOM`` of its budget free."""
    trainer_steps = not fit_owns_optimizer(opts)
    return FitConfig(planner=RECOMPUTE[opts.recompute], compile=opts.compile,
                     stream=opts.stream, prefetch_depth=opts.prefetch,
                     serial_reads=opts.serial_reads, simulated_gpu=tier.simulated,
                     host_updates=opts.host_updates, optimizer_states=opts.optimizer_states,
                     enforce=opts.enforce, unenforced_ok=opts.unenforced_ok,
                     headroom=RAM_HEADROOM if tier.gpu is None and tier.ram is not None
                     and trainer_steps else 0.0)


@dataclasses.dataclass
class StepPlanner:
    """What planning the step needs besides the tier: ``sample`` is one micro-batch of this
    rank (zeros); ``rounding`` the stochastic-rounding streams of the optimizers fit owns;
    when the trainer steps its own optimizer, ``reserve`` is this rank's share of its states
    and ``step_temporaries`` what its step allocates besides (both reserved in the plan: the
    step runs after the backward, with every gradient present; 0 when fit owns it)."""
    opts: TrainOptions
    site: Site
    built: BuiltModel
    sample: dict[str, torch.Tensor]
    rounding: RoundingStreams
    reserve: int
    step_temporaries: int
    logger: Logger
    # fit's progress lines on stdout (the train log; not under eval, whose stdout is JSON)
    progress: bool = True

    @classmethod
    def for_run(cls, run: Run, site: Site, built: BuiltModel, logger: Logger) -> StepPlanner:
        """The planner of ``run``'s step on ``site``; per rank (budgets are per rank, and
        each rank runs batch-size / ranks rows). Measures the trainer's optimizer step."""
        from ..exec.memory import configure_host_allocator
        opts, precision, device = run.opts, site.precision, site.tier.device
        trainable = [p for p in built.model.parameters() if p.requires_grad]
        trainer_steps = not fit_owns_optimizer(opts)
        if site.tier.ram is not None and trainer_steps:
            # as fit will under a RAM budget: freed memory leaves the RSS at once, so the
            # optimizer step's temporaries are measured below as fresh memory (malloc's
            # dynamic threshold would otherwise count heap growth: 25 MB for a 4 MB
            # parameter's step)
            configure_host_allocator()
        # on the GPU: a model still in host RAM (fit owns the optimizer) is placed there by
        # fit, never whole
        sample = planning_sample(opts.batch_size // site.ranks, opts.seq_len,
                                 run.data.train.mask is not None, device)
        return cls(opts, site, built, sample,
                   rounding=RoundingStreams.seeded(device, opts.seed, built.model),
                   reserve=-(-reserved_bytes(trainable, precision) // site.ranks)
                   if trainer_steps else 0,
                   step_temporaries=step_transient_bytes(trainable, opts, precision, device)
                   if trainer_steps else 0,
                   logger=logger)

    @functools.cached_property
    def config(self) -> FitConfig:
        """The ``FitConfig`` of the plan and of every re-plan (``fit_config``)."""
        return fit_config(self.opts, self.site.tier)

    def plan(self, tier: ComputeTier) -> Any:
        """``tierflow.fit`` under ``tier``'s budgets, less what the process already holds of
        --ram; the fitted module."""
        opts, model = self.opts, self.built.model
        held = tier.held_outside_the_plan(model, self.site.baseline)
        if held:
            self.logger.print(f"{format_bytes(held)} of --ram is held before planning "
                              "(torch's first-use caches, a GPU's runtime, the model's "
                              "objects): the plan gets the rest")
        owned = fit_owns_optimizer(opts)
        try:
            with torch.random.fork_rng(devices=[]), self.site.autocast():
                if owned:  # weights and states may be on the tiers below, the disk's included
                    fitted = fit.fit(model, self.sample, **tier.fit_budgets(held),
                                     config=self.config,
                                     # a model built onto the disk tier brings its own
                                     disk=None if self.built.on_disk else self.site.disk,
                                     optimizer=self._owned_optimizer,
                                     grad_accum=opts.grad_accum,
                                     max_grad_norm=opts.clip if opts.clip > 0 else None,
                                     verbose=self.progress and self.site.is_main)
                    self.rounding.reseed(opts.seed)  # the optimizer probe drew from it
                    self._say_enforcement(fitted)
                    self._keep_profile(fitted, held)
                    return fitted
                fitted = fit.fit(model, self.sample, **tier.fit_budgets(held),
                                 reserve=self.reserve + self.step_temporaries,
                                 grad_accum=opts.grad_accum, config=self.config,
                                 verbose=self.progress and self.site.is_main)
                self._say_enforcement(fitted)
                return fitted
        except BudgetError as e:
            error = tier.over_budget(e, held)
            raise (error if owned else tier.suggest_lower_tiers(error)) from None

    def _keep_profile(self, fitted: Any, held: int) -> None:
        """Keep what ``fit`` measured, with the bytes of --ram held outside its plan, where
        `tierflow plan --measure` plans the same run (``profile/kept_profiles.py``): one
        process on the CPU, the whole model training (called where fit owns the optimizer:
        a run with a disk tier)."""
        opts, site = self.opts, self.site
        if fitted.measured is None or site.world is not None or site.tier.gpu is not None \
                or opts.freeze or opts.train_only or opts.lora:
            return
        model = shape_from_config(self.built.model.config.to_dict()).architecture()
        shape = RunShape(model, opts.batch_size, opts.seq_len, site.precision.to_dict(),
                         site.tier.ram, site.disk is not None,
                         packed="position_ids" in self.sample, compiled=opts.compile)
        keep_profile(shape, dataclasses.replace(fitted.measured, held=held))

    def _say_enforcement(self, fitted: Any) -> None:
        """Print what ``fit`` said of the memory cgroup (--enforce): entered, or why not."""
        for note in fitted.fit_log:
            if note.startswith(enforce.NOTE):
                self.logger.print(note)

    def _owned_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """One stage's optimizer, as ``fit`` builds it for the stages it owns."""
        params = list(params)
        return build_optimizer(param_groups(params, self.opts), self.opts, self.site.precision,
                               self.rounding.for_params(params))

    def report(self, module: Any) -> None:
        """Print the ``[Plan]`` section of the planned ``module`` and its record: placement,
        peaks, the gradient bytes (one stage's when fit owns the optimizer: each stage's
        gradients are freed by its update), the optimizer step's ``step_temporaries``
        (reserved with the states), the precision's bytes per parameter and, under
        torchrun, the measured bus and predicted communication."""
        opts, site, precision = self.opts, self.site, self.site.precision
        world, ranks = site.world, site.ranks
        trainable = [p for p in self.built.model.parameters() if p.requires_grad]
        grads = sum(p.nbytes for p in trainable)
        if fit_owns_optimizer(opts):
            grads = max((sum(p.nbytes for p in ps) for ps in module.optimizer.stage_params),
                        default=0)
        replicas = ranks_hold_replicas(opts)
        dist_figures = None
        if world is not None:
            # the plan's collectives (replicas: gradients all-reduced; ZeRO-2: reduce-scattered,
            # then the updated shards all-gathered after the step; the step's exchanges)
            plan = module.plan
            bus = plan.transfers.reductions.bus
            moved = sum(op.nbytes for op in (*plan.ops, *plan.routines.gathers,
                                             *plan.routines.exchanges)
                        if isinstance(op, (*COLLECTIVES, Exchange)))
            dist_figures = {"world_size": ranks, "backend": world.backend, "bus_bandwidth": bus,
                            "comm_bytes": moved, "replicas": replicas,
                            "predicted_comm_s": moved / bus}
        per = precision.bytes_per_parameter()
        count = sum(p.numel() for p in trainable)
        shards = 1 if replicas else ranks  # replicas: each rank holds every state
        frozen = sum(p.numel() for p in {id(p): p for stage in module.chain.stages
                                         for p in stage.parameters()}.values()
                     if not p.requires_grad)
        table, fields = plan_section(
            module.plan, grads=grads, budget=site.tier.plan_budget, grad_accum=opts.grad_accum,
            dist=dist_figures,
            precision=PlanPrecision(per, trainable=count,
                                    master=int(per.master * count) // shards,
                                    dtypes=precision.to_dict(), frozen=frozen,
                                    tied_frozen=tuple(tied_frozen(module.model))),
            update_pass=module.update_pass, step_temporaries=self.step_temporaries)
        self.logger.print()
        self.logger.print(table)
        self.logger.print(module.plan.explain())
        self.logger.record("plan", **fields)

    def replan_after_oom(self, module: Any, tier: ComputeTier, optimizer: Any,
                         step: int) -> tuple[Any, ComputeTier]:
        """Plan the step again under 80% of the planned peak that did not fit (or, when no
        plan fits that, under the least budget that works, if that is below the peak); the
        module and the tier to retry the step with. The plan is made from the costs already
        measured: measuring the stages again would need GPU memory that just ran out. The
        peak is the planner's (``Plan.planned_peak``: every buffer of transfers held), which
        the least budget that works is measured against."""
        from ..plan.choose import make_plan
        was, peak, costs = tier.gpu, module.plan.planned_peak, module.plan.costs
        # an update pass after the backward keeps its own peak: the plan may not go below it
        floor = module.update_pass.peak if module.update_pass is not None else 0
        if floor >= peak:
            raise _no_smaller_plan(step, peak, floor)
        tier = dataclasses.replace(tier, gpu=max(int(0.8 * min(was, peak)), floor))
        try:
            plan = make_plan(costs, tier.gpu, self.config, tier="gpu")
        except BudgetError as e:
            plan = None
            least = max(e.smallest, floor)
            if least < peak:
                tier = dataclasses.replace(tier, gpu=least)
                with contextlib.suppress(BudgetError):  # rotor's rounded table may need more
                    plan = make_plan(costs, tier.gpu, self.config, tier="gpu")
            if plan is None:
                raise _no_smaller_plan(step, peak, least) from None
        module.abandon_step()
        module = module.with_plan(plan)
        optimizer.zero_grad()
        if tier.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        self.logger.print(f"the GPU ran out of memory at step {step}: re-planned under "
                          f"{format_bytes(tier.gpu)} (was {format_bytes(was)}, planned peak "
                          f"{format_bytes(peak)}): {module.plan.strategy}, predicted peak "
                          f"{format_bytes(module.plan.predicted_peak)}; retrying the step once")
        self.logger.record("replan", step=step, gpu_budget=tier.gpu, previous_budget=was,
                           predicted_peak=module.plan.predicted_peak,
                           strategy=module.plan.strategy)
        return module, tier


def _no_smaller_plan(step: int, peak: int, least: int) -> TierflowError:
    return TierflowError(f"the GPU ran out of memory at step {step} and no plan needs less "
                         f"than the {format_bytes(peak)} that did not fit (the least that "
                         f"works is {format_bytes(least)}): give a smaller --batch-size or "
                         "--seq-len, or free the GPU")
