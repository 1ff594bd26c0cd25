"""``tierflow.fit``: a model, a sample and a budget in; a drop-in module that trains the same
parameters with the same gradients inside the budget out."""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .chain import to_chain
from .chain.base import Chain
from .config import FitConfig
from .errors import BudgetError, TierflowError
from .exec.boundaries import BoundaryStash
from .exec.compile import compile_chain
from .exec.context import AutocastMode, untouched
from .exec.deferred import DeferredUpdates
from .exec.gradients import GradientStash
from .exec.host_model import start_in_host_ram, start_on_disk
from .exec.host_update import HostUpdates
from .exec.memory import (
    CACHING_THRESHOLD,
    EXACT_THRESHOLD,
    HostRoom,
    caching_allocator,
    configure_host_allocator,
    meter_for,
    return_free_memory,
)
from .exec.offload import OffloadedParameters, attach, offloaded_parameters
from .exec.optimizer import OwnedOptimizer
from .exec.stage_call import context_tensors, storage_key
from .exec.tapes import TapeOffload
from .exec.weights import WeightStreamer, stage_parameters_to_stream
from .module import TierflowModule
from .plan.choose import make_plan
from .plan.costs import ChainCosts
from .plan.tier_candidates import UpdateRates
from .plan.tier_costs import LowerTier
from .plan.tier_search import LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK, TierPlan, auto_head_chunk
from .profile.head_chunk import head_profile_bytes
from .profile.profiler import profile_chain
from .tiers import lower_tiers, place, update_rates
from .units import budget_to_give, format_bytes, parse_bytes

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def fit(model: nn.Module, sample: Any, *, ram: int | str | None = None,
        gpu: int | str | None = None, planner: str = "auto",
        optimizer: OptimizerFactory | None = None, disk: str | Path | None = None,
        reserve: int | str = 0, grad_accum: int = 1, max_grad_norm: float | None = None,
        config: FitConfig | None = None, verbose: bool = False) -> TierflowModule:
    """Plan ``model``'s training step for ``sample`` under the budgets and return a drop-in.

    ``sample`` is what you call the model with: a tensor, a tuple of arguments or a dict of
    keyword arguments (``{"input_ids": ..., "labels": ...}`` for Hugging Face models).
    Budgets are bytes or strings like ``"2GiB"`` and cover everything the step holds on that
    tier: parameters, gradients, optimizer states (when tierflow owns the optimizer) and
    activations. Call ``fit`` under the same autocast mode you will train with.
    ``optimizer`` is a factory such as ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``; it is
    called once per stage, and updates then happen during ``backward()``. Without it, step
    your own optimizer and give the bytes it holds while it steps as ``reserve`` (its states,
    AdamW's 2x the fp32 parameter bytes, and the temporaries of its step): the plan leaves
    them free on the compute tier. ``disk`` is a directory for
    the disk tier: when the optimizer's states do not fit the budget beside the rest, they
    live there between updates, and so do the weights of the stages that do not fit
    (streamed in ahead of their use); with ``ram=`` too, a model in RAM moves to the disk
    tier before it is profiled, one stage's weights in memory at a time (as ``tierflow
    train --disk`` builds one there), and the stages that do not stream come back for good.
    Parameters with ``requires_grad`` False take no gradient and no optimizer state; the
    stages that hold them stream them like the others. Under ``gpu=``, a model on the CPU
    with a sample on the GPU is never whole on the GPU: its weights wait in host RAM, or on
    disk when it was loaded there (``models.load_model(..., offload=...)``), and come up as
    the plan says.
    With ``optimizer=``, ``grad_accum`` (micro-batches per update: call ``backward()`` that
    many times, on losses divided by it as in plain PyTorch) and ``max_grad_norm`` (clip
    by the global norm, as ``torch.nn.utils.clip_grad_norm_``) move the updates to one pass
    after the last micro-batch's backward; ``last_grad_norm`` then gives the norm. Without
    it, ``grad_accum`` > 1 says that your optimizer steps after that many backwards: the
    gradients then live for the whole step, and the plan holds them as static bytes.
    """
    config = config or FitConfig(planner=planner)
    if planner != "auto" and config.planner != planner:
        raise TierflowError(f"planner={planner!r} disagrees with config.planner="
                            f"{config.planner!r}: give one or the other")
    if gpu is not None and not config.simulated_gpu:
        target = _sample_device(sample)
        if _device_of(model).type == "cpu" and target.type != "cpu":
            # computes on the GPU, never whole there: streamed from host RAM, or from disk
            built_on_disk = offloaded_parameters(model)
            if built_on_disk is None:
                start_in_host_ram(model, target)
            else:
                built_on_disk.move_model(model, target)
    device = _device_of(model)
    tier, budget, ram_below = _compute_budget(device, ram=ram, gpu=gpu,
                                              simulated=config.simulated_gpu)
    reserved = parse_bytes(reserve, what="reserve") if reserve else 0
    if grad_accum < 1:
        raise TierflowError(f"grad_accum={grad_accum} must be at least 1")
    from .models.int8 import Int8Linear
    int8 = next((name for name, m in model.named_modules() if isinstance(m, Int8Linear)), None)
    if int8 is not None:
        raise TierflowError(f"the model's {int8} is an int8 layer (tierflow.quantize_int8), "
                            "which is for generation: fit the model as it was before quantizing")
    args, kwargs = _as_call(sample)
    if not any(p.requires_grad for p in model.parameters()) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())):
        raise TierflowError("no parameter of the model requires grad, nor does the sample: "
                            "there is nothing to train; unfreeze what should train "
                            "(p.requires_grad_(True))")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise TierflowError(f"max_grad_norm={max_grad_norm} must be > 0 (None: no clipping)")
    if optimizer is None and max_grad_norm is not None:
        raise TierflowError("max_grad_norm= applies to an optimizer tierflow owns: pass "
                            "optimizer= too, or clip around your own optimizer as in plain "
                            "PyTorch")
    deferred = optimizer is not None and (grad_accum > 1 or max_grad_norm is not None)
    grads_resident = optimizer is None and grad_accum > 1  # accumulated by the caller
    offloaded = offloaded_parameters(model)
    if offloaded is not None and disk is None and offloaded.store.kind == "disk":
        disk = offloaded.store.directory  # the model's own disk tier
    if disk is not None and optimizer is None:
        raise TierflowError("disk= holds optimizer states and weights, which tierflow moves "
                            "only when it owns the optimizer: pass optimizer= too, or leave "
                            "disk out")
    host_tier = tier != "ram"  # under a GPU, real or simulated, host RAM is the next tier
    _check_states_tier(config.optimizer_states, optimizer is not None, host_tier,
                       disk is not None)
    if config.stream == "all" and disk is None and not host_tier:
        raise TierflowError("config.stream='all' streams weights from the disk tier: give "
                            "disk=DIR too, or use stream='auto'")
    came_in_ram = 0  # bytes of weights above the budget that the caller held in RAM
    if disk is not None and offloaded is None and budget is not None and tier == "ram":
        # as `tierflow train --disk` builds a model: its weights wait on disk and each stage
        # is profiled with its own alone, never the whole model beside a stage's profile
        held = sum({storage_key(p): p.untyped_storage().nbytes()
                    for p in model.parameters()}.values())
        came_in_ram = held if held > budget else 0
        offloaded = start_on_disk(model, disk)
    lower = lower_tiers(device, disk, ram_below, host_tier, offloaded) if optimizer else []
    exact_host = budget is not None and tier == "ram"
    if exact_host:
        configure_host_allocator(EXACT_THRESHOLD)  # freed memory leaves the RSS at once
    log: list[str] = []
    say = (lambda m: (log.append(m), print(f"[tierflow] {m}", flush=True))) if verbose \
        else log.append
    started = time.perf_counter()
    autocast = AutocastMode.capture(device.type)
    if device.type == "cpu":
        return_free_memory()  # what malloc cached before fit is not the process's to keep
    before = meter_for(device).current()  # what the first runs leave resident counts from here
    # the RSS the budget does not cover: the process itself, less the parameters it holds
    outside_budget = before - sum({storage_key(p): p.untyped_storage().nbytes()
                                   for p in model.parameters()}.values())
    rates = None if optimizer is None else functools.cache(functools.partial(
        update_rates, list(model.parameters()), optimizer, device, meter_for(device), budget,
        lower))  # measured at the first plan, once for every plan
    attempt = functools.partial(_profile_and_plan, model, sample, device, autocast, budget, tier,
                                reserved, rates, lower, config, say, before, deferred,
                                grads_resident, grad_accum > 1)
    try:
        if config.head_chunk_tokens is not None:
            chain, placed = attempt(config.head_chunk_tokens)
        else:
            chain, placed = auto_head_chunk(attempt, lambda result: result[1],
                                            _large_head_chunk_fits(
                                                model, sample, budget,
                                                meter_for(device).current() - outside_budget,
                                                say))
    except BudgetError as e:
        if e.tier == tier:  # its smallest holds what this process measured
            keyword = "ram" if tier == "ram" else "gpu"
            e.args = (f"{e}; a new process measures the runtime's bytes a few MiB "
                      f"differently: there give {keyword}=\"{budget_to_give(e.smallest)}\" "
                      "or more",)
        raise
    plan = placed.plan
    if came_in_ram:
        note = (f"the model came in RAM with {format_bytes(came_in_ram)} of weights, above the "
                f"budget of {format_bytes(budget)}: the process held them before fit moved "
                "them to the disk tier; build a model larger than the budget there "
                "(tierflow.load_model(..., disk=DIR))")
        say(note)
        plan = replace(plan, notes=plan.notes + (note,))
    states = placed.states.store if placed.states else None
    depth = 0 if config.serial_reads else placed.depth  # stages read ahead as the step runs
    if depth != placed.depth:
        plan = replace(plan, notes=plan.notes + (
            f"every read runs on demand (serial_reads): the plan reads {placed.depth} stage(s) "
            "ahead, and its predicted step assumes it",))
    owned = OwnedOptimizer(chain, optimizer, states, read_ahead=depth > 0) \
        if optimizer is not None else None
    streamer = _stream(model, chain, placed, depth, updates_in_backward=not deferred)
    if placed.host_stages:
        streamed = frozenset(id(p) for ps in streamer.stage_params.values() for p in ps) \
            if streamer is not None else frozenset()
        owned.step_on_host(HostUpdates(set(placed.host_stages), device,
                                       streamer.offloaded if streamer else None, streamed,
                                       read_ahead=depth > 0),
                           optimizer)
    host_room = None
    if exact_host:  # profiled with exact thresholds; steps cache, and trim where they must
        configure_host_allocator(CACHING_THRESHOLD)
        # malloc's caches stay while the RSS is under the predicted peak: the peak a user
        # measures is then the plan's, and the room the budget leaves stays free
        host_room = HostRoom(placed.predicted_peak + outside_budget)
        host_room.start_guard(budget + outside_budget)  # what the budget allows, at any moment
        plan = replace(plan, notes=plan.notes + (
            "malloc keeps freed memory for reuse (no page faults on fresh memory) and gives "
            "it back before an operation only when the RSS plus what the operation adds "
            "would pass the predicted peak",))
    updates = None
    if deferred:
        stash = GradientStash(placed.weights.store, streamer.stage_params) if streamer else None
        room = None
        if host_room is not None:  # what the pass adds over the static bytes, at its peak
            growth = placed.update_pass.peak - placed.plan.costs.static_bytes
            room = functools.partial(host_room.make_room, growth, fresh=True)
        updates = DeferredUpdates(owned, grad_accum, max_grad_norm, streamer, stash, room)
    say(f"planned in {time.perf_counter() - started:.1f} s: {plan.strategy}")
    tapes = None
    if placed.tapes is not None:
        tapes = TapeOffload(placed.tapes.store, set(placed.tape_stages),
                            {storage_key(p) for p in model.parameters()},
                            read_ahead=depth > 0)
    boundaries = BoundaryStash(placed.boundaries.store) if placed.boundaries else None
    return TierflowModule(model, chain, plan, autocast, device, owned, log, streamer,
                          updates, tapes, host_room, boundaries, placed.update_pass)


def _check_states_tier(states: str, owned: bool, host_tier: bool, disk: bool) -> None:
    """TierflowError when ``config.optimizer_states`` names a tier this fit cannot use."""
    if states == "auto":
        return
    if not owned:
        raise TierflowError(f"config.optimizer_states={states!r} places the states of an "
                            "optimizer tierflow owns: pass optimizer= too, or leave it 'auto'")
    if states == "ram" and not host_tier:
        raise TierflowError("config.optimizer_states='ram' keeps them in the host RAM below a "
                            "GPU: give gpu= too (on the CPU, RAM is the compute tier: "
                            "'compute')")
    if states == "disk" and not disk:
        raise TierflowError("config.optimizer_states='disk' keeps them on the disk tier: give "
                            "disk=DIR too")


def _stream(model: nn.Module, chain: Chain, placed: TierPlan, depth: int, *,
            updates_in_backward: bool) -> WeightStreamer | None:
    """Hand the streamed stages' weights to a streamer and bring every other weight of a model
    that starts on disk into memory for good."""
    offloaded = offloaded_parameters(model)
    streamable = stage_parameters_to_stream(chain.stages)
    streamed = {i: streamable[i] for i in sorted(placed.streamed)}
    moving = {id(p) for params in streamed.values() for p in params}
    if offloaded is not None:
        offloaded.keep_resident(p for p in model.parameters()
                                if p in offloaded and id(p) not in moving)
    if not streamed:
        return None
    if offloaded is None:
        offloaded = OffloadedParameters(placed.weights.store)
        attach(model, offloaded)
    names = {id(p): name for name, p in model.named_parameters()}
    streamer = WeightStreamer(streamed, offloaded, depth, names, updates_in_backward,
                              placed.host_stages)
    streamer.prefetch(placed.plan.ops)
    return streamer


def _profile_and_plan(model: nn.Module, sample: Any, device: torch.device,
                      autocast: AutocastMode, budget: int | None, tier: str, reserved: int,
                      rates: Callable[[], UpdateRates] | None, lower: list[LowerTier],
                      config: FitConfig, say: Callable[[str], Any], before: int,
                      deferred: bool, grads_resident: bool, accumulates: bool,
                      head_chunk_tokens: int) -> tuple[Chain, TierPlan]:
    """Cut the model into a chain, measure its stages and plan the step under the budget.
    ``before`` is the RSS when fit began: growth since then is the runtime's resident share.
    ``grads_resident``: the caller accumulates gradients over micro-batches (static bytes);
    ``accumulates``: the owned optimizer's deferred updates come after several.
    ``rates``: the owned optimizer's update rates (None: the caller steps its own)."""
    meter = meter_for(device)
    exact_host = budget is not None and tier == "ram"  # memory measured with exact thresholds
    offloaded = offloaded_parameters(model)
    args, kwargs = _as_call(sample)
    # runs of the whole model, under the caller's autocast without its weight-cast cache
    # (cached bf16 copies of every weight would stay until the caller's autocast block ends)
    with offloaded.on_demand(model) if offloaded else contextlib.nullcontext(), autocast():
        chain = to_chain(model, sample, head_chunk_tokens=head_chunk_tokens)
        x0, ctx = chain.split_inputs(*args, **kwargs)
    if config.compile:
        say(f"compiling {compile_chain(chain)} stages (the first profile round pays for it)")
    with untouched(model, device):
        stage_costs, shared = profile_chain(chain, x0, ctx, autocast, meter,
                                            resident=offloaded.resident if offloaded else None,
                                            repeats=config.profile_repeats, log=say,
                                            timing=caching_allocator if exact_host else None)
    # what running the model left resident (kernel caches, compiled code, allocator slack; on
    # CUDA the cuBLAS workspaces of the forward's and the autograd thread's handles, 32 MiB
    # each on an H100): it stays for the whole run, so it is planned as static
    if device.type == "cpu":
        return_free_memory()
    runtime = max(0, meter.current() - before)
    param_bytes = sum(p.nbytes for p in model.parameters())
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad) if grads_resident \
        else 0
    extra = {"autocast": autocast.describe(), "device": str(device), "parameters": param_bytes,
             "gradients": grads, "reserved": reserved, "runtime": runtime}
    inputs = [x0] if isinstance(x0, torch.Tensor) else []
    x0_keys = {storage_key(t) for t in inputs}
    context = {storage_key(t): t.untyped_storage().nbytes() for t in context_tensors(ctx)
               if storage_key(t) not in x0_keys}
    costs = ChainCosts(stages=tuple(stage_costs),
                       input_bytes=sum(t.untyped_storage().nbytes() for t in inputs),
                       context_bytes=sum(context.values()),
                       static_bytes=param_bytes + grads + runtime + reserved,
                       shared_grad_bytes=shared, grads_resident=grads_resident, extra=extra)
    if rates is None:
        return chain, TierPlan(make_plan(costs, budget, config, tier=tier), None)
    weights_from = [t for t in lower if offloaded is not None and t.store is offloaded.store]
    return chain, place(costs, chain, rates(), budget, config, tier, lower, deferred,
                        weights_from if offloaded is not None else None, accumulates)


def _large_head_chunk_fits(model: nn.Module, sample: Any, budget: int | None, in_use: int,
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


def _as_call(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


def _sample_device(sample: Any) -> torch.device:
    """The device of the sample's first tensor (the CPU when it has none)."""
    args, kwargs = _as_call(sample)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _device_of(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise TierflowError(f"the model's parameters are on several devices "
                            f"({', '.join(sorted(map(str, devices)))}): move it to one device first")
    return devices.pop() if devices else torch.device("cpu")


def _compute_budget(device: torch.device, *, ram: int | str | None, gpu: int | str | None,
                    simulated: bool) -> tuple[str, int | None, int | None]:
    """The compute tier's name and budget and the budget of host RAM below it (None: no
    host tier): ``ram`` on the CPU; ``gpu`` over ``ram`` on an accelerator or a simulated GPU."""
    parse = lambda value, what: None if value is None else parse_bytes(value, what=what)  # noqa: E731
    if device.type == "cpu" and not simulated:
        if gpu is not None:
            raise TierflowError(f"gpu={gpu!r} was given but the model and the sample are on "
                                "the CPU: give the sample on the GPU (the model may stay in "
                                "host RAM), give ram= instead, or simulate a GPU with "
                                "config=FitConfig(simulated_gpu=True)")
        return "ram", parse(ram, "ram budget"), None
    if device.type == "cpu" and gpu is None:
        raise TierflowError("FitConfig(simulated_gpu=True) needs gpu=: the budget of the "
                            "simulated GPU")
    name = "gpu (simulated)" if device.type == "cpu" else "gpu"
    return name, parse(gpu, "gpu budget"), parse(ram, "ram budget")
