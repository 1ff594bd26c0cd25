"""Cut the model into a chain, measure its stages and plan its step: the profile and plan
steps of ``fit``, once per LM-head chunk size it tries."""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ..chain import to_chain
from ..chain.base import Chain
from ..core.errors import BudgetError
from ..core.units import budget_to_give, format_bytes
from ..exec.compile import compile_chain
from ..exec.context import untouched
from ..exec.memory import ALLOCATOR_SLACK, caching_allocator, meter_for, return_free_memory
from ..exec.optimizer import OptimizerFactory
from ..plan.choose import fastest_plan
from ..plan.costs import ChainCosts
from ..plan.measured import Measured
from ..plan.tier_candidates import UpdateRates
from ..plan.tier_search import LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK, TierPlan, auto_head_chunk
from ..profile.head_chunk import head_profile_bytes
from ..profile.profiler import Measuring, held_inputs, profile_chain
from .request import FitRequest, as_call
from .start import FitStart
from .tiers import PlacedTiers, place, update_rates


def profile_and_place(model: nn.Module, sample: Any, request: FitRequest,
                      start: FitStart) -> tuple[Chain, TierPlan, Measured | None]:
    """The chain, its plan and what was measured to plan it (None: the caller steps its own
    optimizer): profiled and planned with the LM head's chunk size of the config, or the
    better of a large and a small one (``auto_head_chunk``); a BudgetError of the compute
    tier names the budget a new process should give."""
    rates = None if request.optimizer is None else functools.cache(functools.partial(
        _timed_update_rates, start, list(model.parameters()), request.optimizer))
    profiled: dict[int, ChainCosts] = {}  # per LM-head chunk tried

    def attempt(head_chunk_tokens: int) -> tuple[Chain, TierPlan]:
        return _profile_and_plan(model, sample, request, start, rates, head_chunk_tokens,
                                 profiled)

    try:
        if request.config.head_chunk_tokens is not None:
            chain, placed = attempt(request.config.head_chunk_tokens)
        else:
            in_use = meter_for(start.device).current() - start.outside_budget
            chain, placed = auto_head_chunk(
                attempt, lambda result: result[1],
                large_head_chunk_fits(model, sample, start.budget, in_use, start.say))
    except BudgetError as e:
        if e.tier == start.tier:  # its smallest holds what this process measured
            keyword = "ram" if start.tier == "ram" else "gpu"
            e.args = (f"{e}; a new process measures the runtime's bytes a few MiB "
                      f"differently: there give {keyword}=\"{budget_to_give(e.smallest)}\" "
                      "or more",)
        raise
    if rates is None:
        return chain, placed, None
    disk = [(t.read_bytes_per_s, t.write_bytes_per_s) for t in start.lower if t.name == "disk"]
    return chain, placed, Measured(dict(profiled), rates(), disk[0] if disk else None)


def _timed_update_rates(start: FitStart, params: list[nn.Parameter],
                        optimizer: OptimizerFactory) -> UpdateRates:
    """``update_rates`` (once, for every plan) within the room the budget leaves now,
    saying how long its probes took (seconds on a large model: a compiled kernel's first
    step among them)."""
    began = time.perf_counter()
    meter = meter_for(start.device)
    room = None if start.budget is None else \
        start.budget - (meter.current() - start.outside_budget)
    rates = update_rates(params, optimizer, start.device, meter, start.budget, start.lower,
                         room)
    start.say(f"measured the optimizer's updates in {time.perf_counter() - began:.1f} s")
    return rates


def _profile_and_plan(model: nn.Module, sample: Any, request: FitRequest, start: FitStart,
                      rates: Callable[[], UpdateRates] | None, head_chunk_tokens: int,
                      profiled: dict[int, ChainCosts]) -> tuple[Chain, TierPlan]:
    """Cut the model into a chain with LM-head chunks of ``head_chunk_tokens``, measure its
    stages (their costs go into ``profiled``) and plan the step under the budget. Growth of
    the meter since fit began is the runtime's resident share. ``rates``: the owned
    optimizer's update rates (None: the caller steps its own)."""
    device, config, say = start.device, request.config, start.say
    meter = meter_for(device)
    offloaded = start.offloaded
    args, kwargs = as_call(sample)
    # runs of the whole model, under the caller's autocast without its weight-cast cache
    # (cached bf16 copies of every weight would stay until the caller's autocast block ends)
    with offloaded.on_demand(model) if offloaded else contextlib.nullcontext(), \
            start.autocast():
        chain = to_chain(model, sample, head_chunk_tokens=head_chunk_tokens)
        x0, ctx = chain.split_inputs(*args, **kwargs)
    if config.compile:
        say(f"compiling {compile_chain(chain)} stages (the first profile round pays for it)")
    with untouched(model, device):
        measuring = Measuring.of(config, meter, _timing(start))
        stage_costs, shared = profile_chain(chain, x0, ctx, start.autocast, measuring,
                                            resident=offloaded.resident if offloaded else None,
                                            log=say)
    # what running the model left resident (kernel caches, compiled code, allocator slack; on
    # CUDA the cuBLAS workspaces of the forward's and the autograd thread's handles, 32 MiB
    # each on an H100): it stays for the whole run, so it is planned as static
    if device.type == "cpu":
        return_free_memory()
    runtime = max(0, meter.current() - start.before)
    costs = _chain_costs(model, x0, ctx, stage_costs, shared, runtime, request, start)
    costs = replace(costs, extra={**costs.extra, "head chunk": head_chunk_tokens})
    profiled[head_chunk_tokens] = costs
    if rates is None:
        return chain, TierPlan(fastest_plan(costs, start.budget, config, tier=start.tier), None)
    tiers = PlacedTiers(start.tier, tuple(start.lower), start.weights_from, request.deferred,
                        request.grad_accum, config)
    return chain, place(costs, chain, rates(), start.budget, tiers)


def _timing(start: FitStart) -> Callable[[], Any] | None:
    """The context the profile times its stages in: under a RAM budget, malloc's caching
    thresholds as steps run with, their caches given back before the RSS passes the budget
    (the budget covers the profile too); None: as memory is measured."""
    if not start.exact_host:
        return None
    return functools.partial(caching_allocator, start.budget + start.outside_budget)


def _chain_costs(model: nn.Module, x0: Any, ctx: dict[str, Any], stage_costs: list,
                 shared: int, runtime: int, request: FitRequest,
                 start: FitStart) -> ChainCosts:
    """The planner's input: the stages' measured costs, the chain's input and context, and
    what is static for the whole step (parameters, the caller's accumulated gradients, the
    runtime's share, what the caller reserved for its optimizer, what the process held above
    the caller's baseline before fit)."""
    param_bytes = sum(p.nbytes for p in model.parameters())
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad) \
        if request.grads_resident else 0
    # the RSS a RAM budget covers is the live bytes and what malloc holds beside them
    allocator = ALLOCATOR_SLACK if start.exact_host else 0
    extra = {"autocast": start.autocast.describe(), "device": str(start.device),
             "parameters": param_bytes, "gradients": grads, "reserved": request.reserve,
             "runtime": runtime, "allocator": allocator, "held before fit": start.held_before}
    input_bytes, context_bytes = held_inputs(x0, ctx)
    return ChainCosts(stages=tuple(stage_costs), input_bytes=input_bytes,
                      context_bytes=context_bytes,
                      static_bytes=param_bytes + grads + runtime + allocator + request.reserve
                      + start.held_before,
                      shared_grad_bytes=shared, grads_resident=request.grads_resident,
                      extra=extra)


def large_head_chunk_fits(model: nn.Module, sample: Any, budget: int | None, in_use: int,
                          say: Callable[[str], Any]) -> bool:
    """Whether profiling the LM head in chunks of LARGE_HEAD_CHUNK tokens stays inside the
    budget (``profile/head_chunk.py``) beside the ``in_use`` bytes it counts already (the
    weights in memory and what the run has allocated since fit began); says so when not."""
    if budget is None:
        return True
    needs = head_profile_bytes(model, sample, LARGE_HEAD_CHUNK)
    if needs is None or in_use + needs <= budget:
        return True
    say(f"the LM head runs in chunks of {SMALL_HEAD_CHUNK} tokens: profiling chunks of "
        f"{LARGE_HEAD_CHUNK} would take about {format_bytes(needs)} beside the "
        f"{format_bytes(in_use)} in use, above the budget")
    return False
