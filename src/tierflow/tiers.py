"""Where ``fit`` puts what it owns when tierflow owns the optimizer: the optimizer states and
the stage weights stay on the compute tier or live on a lower tier between uses (the disk;
under a simulated GPU, host RAM first, then the disk).

Every placement that could work is planned (the same rotor plan under the same budget, on the
costs that placement implies), at each prefetch depth unless the config fixes one, and the
fastest plan that fits every tier wins; when nothing fits, the error of the placement that
came closest is raised.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .chain.base import Chain
from .config import FitConfig
from .errors import BudgetError, TierflowError
from .exec import tapes as tape_offload
from .exec.disk import DiskStore, measure_bandwidth
from .exec.host_store import HostStore, measure_copy_bandwidth
from .exec.offload import OffloadedParameters
from .exec.optimizer import probe_optimizer
from .exec.stage_call import storage_key
from .exec.weights import stage_parameters_to_stream
from .plan.choose import make_plan
from .plan.costs import ChainCosts
from .plan.plan import Plan
from .plan.streaming import streamed_costs
from .profile.profiler import with_update_costs
from .tier_costs import (
    Candidate,
    LowerTier,
    UpdatePass,
    deferred_costs,
    lower_bytes,
    states_below,
    where,
    with_offloaded_tapes,
)
from .units import format_bytes

PREFETCH_DEPTHS = (0, 1, 2)  # what the planner tries when the config leaves the depth open
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Placement:
    """A plan and where it keeps things: the lower tier of the optimizer states and of the
    streamed stages' weights (None: the compute tier), and, with deferred updates, the
    update pass."""

    plan: Plan
    states: LowerTier | None = None
    weights: LowerTier | None = None
    streamed: frozenset[int] = frozenset()
    update_pass: UpdatePass | None = None
    tapes: LowerTier | None = None  # where the offloaded tapes go
    tape_stages: frozenset[int] = frozenset()
    depth: int = 1  # stages whose weights, states and tapes are read ahead (0: on demand)

    @property
    def predicted_time(self) -> float:
        """Seconds per micro-batch, plus the update pass (once per step of the accumulation)."""
        return self.plan.predicted_time + (self.update_pass.seconds if self.update_pass else 0.0)

    @property
    def on_lower_tiers(self) -> bool:
        return self.states is not None or self.weights is not None or self.tapes is not None


def place(costs: ChainCosts, chain: Chain, optimizer: OptimizerFactory, device: torch.device,
          meter: Any, budget: int | None, config: FitConfig, tier: str,
          lower: list[LowerTier], deferred: bool = False,
          weights_tiers: list[LowerTier] | None = None) -> Placement:
    """Plan with the optimizer's states on the compute tier or on each lower tier, and with
    the weights of the largest stages (or all) streamed from a lower tier too.
    ``deferred``: updates run in a pass after the backward (see exec/deferred.py).
    ``weights_tiers`` limits where weights may stream from (a model built on disk)."""
    probe = probe_optimizer(optimizer, device, meter)
    largest = [max((p.nbytes for p in st.parameters()), default=0) for st in chain.stages]
    stages = with_update_costs(list(costs.stages), probe.seconds_per_byte,
                               probe.transient_per_byte, largest)
    trainable = sum(p.nbytes for p in chain_parameters(chain) if p.requires_grad)
    state_bytes = int(probe.state_per_byte * trainable)
    state_of = [int(probe.state_per_byte * (st.param_bytes + (costs.shared_grad_bytes
                                                               if i == 0 else 0)))
                for i, st in enumerate(costs.stages)]
    resident = replace(costs, stages=tuple(stages), optimizer_owned=True,
                       static_bytes=costs.static_bytes + state_bytes,
                       extra={**costs.extra, "optimizer states": state_bytes})
    streamable = stage_parameters_to_stream(chain.stages)
    depths = PREFETCH_DEPTHS if config.prefetch_depth is None else (config.prefetch_depth,)
    candidates: list[Candidate] = []
    for depth in depths:
        candidates += _candidates(resident, costs, stages, state_of, state_bytes, chain,
                                  streamable, budget, config, tier, lower, depth,
                                  weights_tiers if weights_tiers is not None else lower)
    plans, error = [], None
    for candidate in candidates:
        try:
            plans.append(_plan(candidate, costs, state_of, probe.seconds_per_byte, budget,
                               config, tier, deferred))
        except BudgetError as e:
            error = e if error is None or e.smallest < error.smallest else error
    if error is None and not plans:
        least = format_bytes(tape_offload.MIN_BYTES)
        raise TierflowError(f"offload_tapes='all' but no stage saves {least} or more for its "
                            "backward: use offload_tapes='auto'")
    if not plans:
        raise error
    return min(plans, key=lambda placed: placed.predicted_time)


def _candidates(resident: ChainCosts, costs: ChainCosts, stages: list, state_of: list[int],
                state_bytes: int, chain: Chain, streamable: dict[int, list[nn.Parameter]],
                budget: int | None, config: FitConfig, tier: str, lower: list[LowerTier],
                depth: int, weights_tiers: list[LowerTier]) -> list[Candidate]:
    """The placements read ``depth`` stages ahead: the optimizer states on the compute tier
    or on each lower tier, with the weights of the largest stages (or all) streamed from a
    lower tier too, and each of those with its tapes offloaded."""
    candidates: list[Candidate] = []
    ahead = f"read {depth} stages ahead of use" if depth else "read when needed"
    for home in [None, *lower]:
        if home is None:
            with_states, notes = resident, ()
        else:
            with_states = states_below(resident, costs, stages, state_of, home, depth > 0)
            notes = (f"the optimizer states ({format_bytes(state_bytes)}) live in {where(home)}"
                     f", {'read ahead of' if depth else 'read at'} each stage's update and "
                     f"written back after ({format_bytes(home.bandwidth)}/s measured)",)
        if config.stream != "all":
            candidates.append(Candidate(with_states, home, None, frozenset(), notes, depth))
        if home is None or config.stream == "never":
            continue
        for source in weights_tiers:
            for streamed in _stream_sets(with_states, streamable, budget, config, tier,
                                         source.bandwidth, depth):
                moved = streamed_costs(with_states, set(streamed),
                                       read_bytes_per_s=source.bandwidth,
                                       write_bytes_per_s=source.bandwidth, depth=depth)
                moved = replace(moved, extra={**moved.extra, "weights tier": source.name})
                why = (f"the weights of {len(streamed)} of {len(chain)} stages "
                       f"({format_bytes(moved.extra['streamed bytes'])}) live in "
                       f"{where(source)}, {ahead} and written back after each update")
                candidates.append(Candidate(moved, home, source, frozenset(streamed),
                                             notes + (why,), depth))
    if lower and config.offload_tapes != "never":
        candidates = with_offloaded_tapes(candidates, lower[0], config)
    return candidates


def lower_tiers(device: torch.device, disk: str | Path | None, ram: int | None,
                host_tier: bool, offloaded: OffloadedParameters | None) -> list[LowerTier]:
    """The tiers below the compute tier, nearest first, with their bandwidths measured: host
    RAM under a GPU (real or simulated), then the disk directory when one is given."""
    tiers = []
    if host_tier:
        tiers.append(LowerTier("ram", HostStore(), measure_copy_bandwidth(), ram))
    if disk is not None:
        if device.type != "cpu":
            raise TierflowError(f"disk={disk} with the model on {device}: the disk tier under "
                                "a GPU is not built yet; give ram= for host memory only")
        same = offloaded is not None and Path(offloaded.store.directory) == Path(disk)
        store = offloaded.store if same else DiskStore(disk)
        tiers.append(LowerTier("disk", store, measure_bandwidth(store.directory)))
    return tiers


def _plan(candidate: Candidate, base: ChainCosts, state_of: list[int], seconds_per_byte: float,
          budget: int | None, config: FitConfig, tier: str, deferred: bool) -> Placement:
    """The candidate's plan, checked against every tier's budget (BudgetError if over)."""
    costs, update_pass, notes = candidate.costs, None, candidate.notes
    if deferred:
        costs, update_pass = deferred_costs(candidate, base, state_of, seconds_per_byte)
    if candidate.states or candidate.weights or candidate.tapes:
        costs = replace(costs, extra={**costs.extra, "prefetch depth": candidate.depth})
    plan = make_plan(costs, budget, config, tier=tier)
    if update_pass is not None:
        if budget is not None and update_pass.peak > budget:
            need = format_bytes(update_pass.peak, round_up=True)
            raise BudgetError(f"{tier} budget {format_bytes(budget)} is below what the update "
                              f"pass after the backward needs, {need}: raise {tier} to at least "
                              f"{need}", tier=tier, budget=budget, smallest=update_pass.peak)
        notes = notes + (f"updates run after the backward (gradient accumulation or "
                         f"clipping): one pass over the stages, last first, predicted "
                         f"{update_pass.seconds:.1f} s at a peak of "
                         f"{format_bytes(update_pass.peak)}",)
    tiers = (candidate.states, candidate.weights, candidate.tapes)
    for lower in {id(t): t for t in tiers if t}.values():
        held = lower_bytes(candidate, base, state_of, lower, deferred)
        if lower.budget is not None and held > lower.budget:
            need = format_bytes(held, round_up=True)
            raise BudgetError(f"{lower.name} budget {format_bytes(lower.budget)} is below the "
                              f"{need} this placement keeps there: raise {lower.name} to at "
                              f"least {need}", tier=lower.name, budget=lower.budget,
                              smallest=held)
    return Placement(replace(plan, notes=plan.notes + notes), candidate.states,
                     candidate.weights, candidate.streamed, update_pass, candidate.tapes,
                     candidate.tape_stages, candidate.depth)


def _stream_sets(costs: ChainCosts, streamable: dict[int, list[nn.Parameter]],
                 budget: int | None, config: FitConfig, tier: str,
                 bandwidth: float, depth: int) -> list[tuple[int, ...]]:
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
                               write_bytes_per_s=bandwidth, depth=depth)
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
