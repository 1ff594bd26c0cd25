"""Where ``fit`` puts what it owns when tierflow owns the optimizer: the optimizer states and
the stage weights stay on the compute tier or live on the disk tier between uses.

Every placement that could work is planned (the same rotor plan under the same budget, on the
costs that placement implies) and the fastest plan that fits wins; when nothing fits, the
error of the placement that came closest is raised.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .chain.base import Chain
from .config import FitConfig
from .errors import BudgetError
from .exec.disk import DiskStore, measure_bandwidth
from .exec.optimizer import probe_optimizer
from .exec.stage_call import storage_key
from .exec.weights import stage_parameters_to_stream
from .plan.choose import make_plan
from .plan.costs import ChainCosts
from .plan.plan import Plan
from .plan.streaming import streamed_costs
from .profile.profiler import with_update_costs
from .units import format_bytes

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class UpdatePass:
    """The update pass after the backward when updates are deferred (gradient accumulation,
    clipping): predicted seconds and compute-tier peak, static bytes included."""

    seconds: float
    peak: int


@dataclass(frozen=True)
class Placement:
    """A plan and where it keeps things: the disk store (None: nothing on disk), the stages
    whose weights stream from it and, with deferred updates, the update pass."""

    plan: Plan
    store: DiskStore | None
    streamed: frozenset[int] = frozenset()
    update_pass: UpdatePass | None = None

    @property
    def predicted_time(self) -> float:
        """Seconds per micro-batch, plus the update pass (once per step of the accumulation)."""
        return self.plan.predicted_time + (self.update_pass.seconds if self.update_pass else 0.0)


def place(costs: ChainCosts, chain: Chain, optimizer: OptimizerFactory, device: torch.device,
          meter: Any, budget: int | None, config: FitConfig, tier: str,
          disk: DiskStore | None, deferred: bool = False) -> Placement:
    """Plan with the optimizer's states on the compute tier; with a disk directory also with
    the states on disk, and with the weights of the largest stages streamed from disk too.
    ``deferred``: updates run in a pass after the backward (see exec/deferred.py)."""
    probe = probe_optimizer(optimizer, device, meter)
    largest = [max((p.nbytes for p in st.parameters()), default=0) for st in chain.stages]
    stages = with_update_costs(list(costs.stages), probe.seconds_per_byte,
                               probe.transient_per_byte, largest)
    trainable = sum(p.nbytes for p in chain_parameters(chain) if p.requires_grad)
    state_bytes = int(probe.state_per_byte * trainable)
    resident = replace(costs, stages=tuple(stages), optimizer_owned=True,
                       static_bytes=costs.static_bytes + state_bytes,
                       extra={**costs.extra, "optimizer states": state_bytes})
    state_of = [int(probe.state_per_byte * (st.param_bytes + (costs.shared_grad_bytes
                                                               if i == 0 else 0)))
                for i, st in enumerate(costs.stages)]
    candidates: list[tuple[ChainCosts, DiskStore | None, frozenset[int], tuple[str, ...]]] = []
    if config.stream != "all":
        candidates.append((resident, None, frozenset(), ()))
    if disk is not None and device.type == "cpu":
        bandwidth = measure_bandwidth(disk.directory)
        offloaded, largest_state = [], 0
        for i, stage in enumerate(stages):
            owned = stage.param_bytes + (costs.shared_grad_bytes if i == 0 else 0)
            state = int(probe.state_per_byte * owned)
            largest_state = max(largest_state, state)
            io = 2 * state / bandwidth  # read ahead during the backward, written back after
            offloaded.append(replace(stage, update_transient=stage.update_transient + state,
                                     update_time=stage.update_time + max(0.0, io - stage.bwd_time)))
        # besides the stage updating: the next one's states read ahead, the last one's writing
        on_disk = replace(resident, stages=tuple(offloaded),
                          static_bytes=costs.static_bytes + 2 * largest_state,
                          extra={**costs.extra, "optimizer states on disk": state_bytes})
        note = (f"the optimizer states ({format_bytes(state_bytes)}) live on disk in "
                f"{disk.directory}, read ahead of each stage's update and written back after "
                f"({format_bytes(bandwidth)}/s measured there)")
        if config.stream != "all":
            candidates.append((on_disk, disk, frozenset(), (note,)))
        if config.stream != "never":
            streamable = stage_parameters_to_stream(chain.stages)
            for streamed in _stream_sets(on_disk, streamable, budget, config, tier, bandwidth):
                moved = streamed_costs(on_disk, set(streamed), read_bytes_per_s=bandwidth,
                                       write_bytes_per_s=bandwidth, depth=config.prefetch_depth)
                why = (f"the weights of {len(streamed)} of {len(chain)} stages "
                       f"({format_bytes(moved.extra['streamed bytes'])}) live on disk too, "
                       f"read {config.prefetch_depth} stages ahead of use and written back "
                       f"after each update")
                candidates.append((moved, disk, frozenset(streamed), (note, why)))
    bandwidth_or_none = bandwidth if disk is not None and device.type == "cpu" else None
    plans, error = [], None
    for candidate, store, streamed, notes in candidates:
        update_pass = None
        if deferred:
            candidate, update_pass = _deferred(candidate, costs, streamed, store is not None,
                                               state_of, probe.seconds_per_byte,
                                               bandwidth_or_none, config.prefetch_depth)
        try:
            plan = make_plan(candidate, budget, config, tier=tier)
        except BudgetError as e:
            error = e if error is None or e.smallest < error.smallest else error
            continue
        if update_pass is not None:
            if budget is not None and update_pass.peak > budget:
                smallest = update_pass.peak
                if error is None or smallest < error.smallest:
                    error = BudgetError(
                        f"{tier} budget {format_bytes(budget)} is below what the update pass "
                        f"after the backward needs, {format_bytes(smallest, round_up=True)}: "
                        f"raise {tier} to at least {format_bytes(smallest, round_up=True)}",
                        tier=tier, budget=budget, smallest=smallest)
                continue
            notes = notes + (f"updates run after the backward (gradient accumulation or "
                             f"clipping): one pass over the stages, last first, predicted "
                             f"{update_pass.seconds:.1f} s at a peak of "
                             f"{format_bytes(update_pass.peak)}",)
        plans.append(Placement(replace(plan, notes=plan.notes + notes), store, streamed,
                               update_pass))
    if not plans:
        raise error
    return min(plans, key=lambda placed: placed.predicted_time)


def _deferred(candidate: ChainCosts, base: ChainCosts, streamed: frozenset[int],
              states_on_disk: bool, state_of: list[int], seconds_per_byte: float,
              bandwidth: float | None, depth: int) -> tuple[ChainCosts, UpdatePass]:
    """A candidate's costs when updates are deferred: the plan's Update(i) only hands a
    streamed stage's gradients to the disk tier (written behind its backward); resident
    stages' gradients stay for the whole step; the optimizer work moves to the update pass."""
    stages, persistent, work, seconds = [], 0, 0, 0.0
    for i, s in enumerate(candidate.stages):
        grads = base.stages[i].param_bytes + (base.shared_grad_bytes if i == 0 else 0)
        compute = seconds_per_byte * base.stages[i].param_bytes
        moved = 2 * state_of[i] if states_on_disk else 0  # states read and written
        if i in streamed:
            write = grads / bandwidth
            stages.append(replace(s, update_time=max(0.0, write - s.bwd_time),
                                  update_transient=0))
            moved += 3 * base.stages[i].param_bytes + grads  # weights in and out, grads in
            work = max(work, base.stages[i].param_bytes + grads)
        else:
            stages.append(replace(s, update_time=0.0, update_transient=0))
            persistent += grads
        if states_on_disk:
            work = max(work, state_of[i] + (base.stages[i].param_bytes + grads
                                            if i in streamed else 0))
        seconds += max(compute, moved / bandwidth) if bandwidth else compute
    costs = replace(candidate, stages=tuple(stages),
                    static_bytes=candidate.static_bytes + persistent)
    # the stage updating (its in-backward update transient: states, weights, temporaries,
    # plus its gradients), `depth` stages read ahead and one written back behind
    peak = costs.static_bytes + (depth + 1) * work + max(
        (s.update_transient for s in candidate.stages), default=0)
    return costs, UpdatePass(seconds, peak)


def _stream_sets(costs: ChainCosts, streamable: dict[int, list[nn.Parameter]],
                 budget: int | None, config: FitConfig, tier: str,
                 bandwidth: float) -> list[tuple[int, ...]]:
    """The stage sets worth streaming: every streamable stage, and (under a budget) the
    fewest of the largest stages that make a plan fit, found by bisection."""
    order = sorted(streamable, key=lambda i: -costs.stages[i].param_bytes)
    if not order:
        return []
    every = tuple(sorted(order))
    if budget is None or config.stream == "all":
        return [every]

    def fits(count: int) -> bool:
        moved = streamed_costs(costs, set(order[:count]), read_bytes_per_s=bandwidth,
                               write_bytes_per_s=bandwidth, depth=config.prefetch_depth)
        try:
            make_plan(moved, budget, config, tier=tier)
        except BudgetError:
            return False
        return True

    if not fits(len(order)):
        return [every]  # the candidate's own error will say what is missing
    low, high = 0, len(order)  # fits(high) holds
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    fewest = tuple(sorted(order[:high]))
    return [fewest] if fewest == every else [fewest, every]


def chain_parameters(chain: Chain) -> list[nn.Parameter]:
    """Every parameter of the chain once, in stage order."""
    seen: dict[int, nn.Parameter] = {}
    for stage in chain.stages:
        for p in stage.parameters():
            seen.setdefault(storage_key(p), p)
    return list(seen.values())
