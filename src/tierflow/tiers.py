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
class Placement:
    """A plan and where it keeps things: the disk store (None: nothing on disk) and the
    stages whose weights stream from it."""

    plan: Plan
    store: DiskStore | None
    streamed: frozenset[int] = frozenset()


def place(costs: ChainCosts, chain: Chain, optimizer: OptimizerFactory, device: torch.device,
          meter: Any, budget: int | None, config: FitConfig, tier: str,
          disk: DiskStore | None) -> Placement:
    """Plan with the optimizer's states on the compute tier; with a disk directory also with
    the states on disk, and with the weights of the largest stages streamed from disk too."""
    probe = probe_optimizer(optimizer, device, meter)
    largest = [max((p.nbytes for p in st.parameters()), default=0) for st in chain.stages]
    stages = with_update_costs(list(costs.stages), probe.seconds_per_byte,
                               probe.transient_per_byte, largest)
    trainable = sum(p.nbytes for p in chain_parameters(chain) if p.requires_grad)
    state_bytes = int(probe.state_per_byte * trainable)
    resident = replace(costs, stages=tuple(stages), optimizer_owned=True,
                       static_bytes=costs.static_bytes + state_bytes,
                       extra={**costs.extra, "optimizer states": state_bytes})
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
    plans, error = [], None
    for candidate, store, streamed, notes in candidates:
        try:
            plan = make_plan(candidate, budget, config, tier=tier)
        except BudgetError as e:
            error = e if error is None or e.smallest < error.smallest else error
            continue
        plans.append(Placement(replace(plan, notes=plan.notes + notes), store, streamed))
    if not plans:
        raise error
    return min(plans, key=lambda placed: placed.plan.predicted_time)


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
