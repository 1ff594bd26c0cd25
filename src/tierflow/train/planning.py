"""How ``tierflow train`` plans its step: ``tierflow.fit`` under the compute tier's budgets,
less what the process already holds (``StepPlanner.plan``); again under a smaller GPU budget
after an out-of-memory error, from the costs already measured (``StepPlanner.replan_after_oom``);
and the ``[Plan]`` section that shows the plan (``report_plan``).

With ``--disk`` tierflow owns the optimizer (``owned.py``): the plan places the weights, the
gradients and the optimizer's states on the tiers; without it the optimizer's states are
``reserve``d in the plan's budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .. import api, enforce
from ..config import FitConfig
from ..errors import BudgetError, TierflowError
from ..models.freeze import tied_frozen
from ..precision import PrecisionConfig
from ..units import format_bytes
from .device import ComputeTier
from .logger import Logger, PlanPrecision, plan_section
from .optimizer import build_optimizer, param_groups
from .options import RECOMPUTE, TrainOptions
from .owned import RoundingStreams

# of the RAM the plan gets without --disk, kept free for what a plan cannot predict: the
# measured peak of llama-20m runs that filled --ram 500MiB and 600MiB came out up to 5.7 MiB
# (1%) above their prediction (benchmarks/ram_budget.py)
RAM_HEADROOM = 0.02


def fit_config(opts: TrainOptions, tier: ComputeTier) -> FitConfig:
    """The ``FitConfig`` of the run's flags. A plan of the CPU under --ram without --disk
    keeps ``RAM_HEADROOM`` of its budget free."""
    return FitConfig(planner=RECOMPUTE[opts.recompute], compile=opts.compile,
                     stream=opts.stream, prefetch_depth=opts.prefetch,
                     serial_reads=opts.serial_reads, simulated_gpu=tier.simulated,
                     host_updates=opts.host_updates, optimizer_states=opts.optimizer_states,
                     enforce=opts.enforce, unenforced_ok=opts.unenforced_ok,
                     headroom=RAM_HEADROOM if tier.gpu is None and tier.ram is not None
                     and not opts.disk else 0.0)


@dataclasses.dataclass
class StepPlanner:
    """What planning the step needs besides the tier: ``sample`` is one micro-batch of this
    rank (zeros); without ``--disk``, ``reserve`` the optimizer's states and
    ``step_temporaries`` what its step allocates besides (both reserved in the plan: the
    step runs after the backward, with every gradient present); ``rounding`` the owned
    optimizers' stochastic-rounding streams (with ``--disk``), ``baseline`` the RSS after
    the imports."""
    opts: TrainOptions
    model: nn.Module
    sample: dict[str, torch.Tensor]
    config: FitConfig
    precision: PrecisionConfig
    rounding: RoundingStreams
    reserve: int
    step_temporaries: int
    disk: Path | None
    baseline: int
    logger: Logger
    autocast: Callable[[], ContextManager]

    def plan(self, tier: ComputeTier) -> Any:
        """``tierflow.fit`` under ``tier``'s budgets, less what the process already holds of
        --ram; the fitted module."""
        opts = self.opts
        held = tier.held_outside_the_plan(self.model, self.baseline)
        if held:
            self.logger.print(f"{format_bytes(held)} of --ram is held before planning "
                              "(torch's first-use caches, the model's objects): the plan gets "
                              "the rest")
        try:
            with torch.random.fork_rng(devices=[]), self.autocast():
                if opts.disk:  # tierflow owns the optimizer: weights and states may be on disk
                    fitted = api.fit(self.model, self.sample, **tier.fit_budgets(held),
                                     config=self.config, disk=self.disk,
                                     optimizer=self._owned_optimizer,
                                     grad_accum=opts.grad_accum,
                                     max_grad_norm=opts.clip if opts.clip > 0 else None)
                    self.rounding.reseed(opts.seed)  # the optimizer probe drew from it
                    self._say_enforcement(fitted)
                    return fitted
                fitted = api.fit(self.model, self.sample, **tier.fit_budgets(held),
                                 reserve=self.reserve + self.step_temporaries,
                                 grad_accum=opts.grad_accum, config=self.config)
                self._say_enforcement(fitted)
                return fitted
        except BudgetError as e:
            error = tier.over_budget(e, held)
            raise (error if opts.disk else tier.suggest_lower_tiers(error)) from None

    def _say_enforcement(self, fitted: Any) -> None:
        """Print what ``fit`` said of the memory cgroup (--enforce): entered, or why not."""
        for note in fitted.fit_log:
            if note.startswith(enforce.NOTE):
                self.logger.print(note)

    def _owned_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """One stage's optimizer, as ``fit`` builds it for the stages it owns."""
        params = list(params)
        return build_optimizer(param_groups(params, self.opts), self.opts, self.precision,
                               self.rounding.for_params(params))

    def replan_after_oom(self, module: Any, tier: ComputeTier, optimizer: Any,
                         step: int) -> tuple[Any, ComputeTier]:
        """Plan the step again under 80% of the predicted peak that did not fit (or, when no
        plan fits that, under the least budget that works, if that is below the peak); the
        module and the tier to retry the step with. The plan is made from the costs already
        measured: measuring the stages again would need GPU memory that just ran out."""
        from ..plan.choose import make_plan
        was, peak, costs = tier.gpu, module.plan.predicted_peak, module.plan.costs
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
                          f"{format_bytes(tier.gpu)} (was {format_bytes(was)}, predicted peak "
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


def report_plan(module: Any, *, opts: TrainOptions, precision: PrecisionConfig,
                tier: ComputeTier, world: Any, trainable: list[nn.Parameter],
                step_temporaries: int, logger: Logger) -> None:
    """Print the ``[Plan]`` section and its record: placement, peaks, the gradient bytes (one
    stage's with ``--disk``: each stage's gradients are freed by its update), the optimizer
    step's ``step_temporaries`` (reserved with the states), the precision's bytes per
    parameter and, under torchrun, the measured bus and predicted communication."""
    from ..distributed import step_seconds
    from ..profile.machine import bus_bandwidth
    ranks = world.size if world is not None else 1
    grads = sum(p.nbytes for p in trainable)
    if opts.disk:
        grads = max((sum(p.nbytes for p in ps) for ps in module.optimizer.stage_params),
                    default=0)
    dist_figures = None
    if world is not None:
        bus = bus_bandwidth(world, torch.device("cpu"))
        # ZeRO-2: gradients reduce-scattered, parameters all-gathered; replicas (--disk):
        # gradients all-reduced, which moves the same bytes
        moved = sum(p.nbytes for p in trainable)
        dist_figures = {"world_size": ranks, "backend": world.backend, "bus_bandwidth": bus,
                        "comm_bytes": 2 * moved, "replicas": bool(opts.disk),
                        "predicted_comm_s": step_seconds(ranks, moved, moved, bus)}
    per = precision.bytes_per_parameter()
    count = sum(p.numel() for p in trainable)
    shards = 1 if opts.disk else ranks  # with --disk each rank holds every state
    frozen = sum(p.numel() for p in {id(p): p for stage in module.chain.stages
                                     for p in stage.parameters()}.values()
                 if not p.requires_grad)
    table, fields = plan_section(
        module.plan, grads=grads, budget=tier.plan_budget, grad_accum=opts.grad_accum,
        dist=dist_figures,
        precision=PlanPrecision(per, trainable=count, master=int(per.master * count) // shards,
                                dtypes=precision.to_dict(), frozen=frozen,
                                tied_frozen=tuple(tied_frozen(module.model))),
        update_pass=module.update_pass, step_temporaries=step_temporaries)
    logger.print()
    logger.print(table)
    logger.print(module.plan.explain())
    logger.record("plan", **fields)
