"""The execute step of ``fit``: what runs the plan (the owned optimizer, the streamer of the
weights that live below, the host RAM's updates, the deferred update pass, the offloaded
tapes and stashed checkpoints, the guard of a RAM budget) around the chain, as the
drop-in module ``fit`` returns."""
from __future__ import annotations

import functools
import time
from dataclasses import replace

from torch import nn

from ..chain.base import Chain
from ..core.units import format_bytes
from ..exec.boundaries import BoundaryStash
from ..exec.deferred import DeferredUpdates
from ..exec.gradients import GradientStash
from ..exec.host_update import HostUpdates
from ..exec.memory import CACHING_THRESHOLD, HostRoom, configure_host_allocator
from ..exec.module import Executors, TierflowModule
from ..exec.offload import OffloadedParameters, attach, offloaded_parameters
from ..exec.optimizer import OwnedOptimizer
from ..exec.stage_call import storage_key
from ..exec.tapes import TapeOffload
from ..exec.transfers import transfer_to
from ..exec.weights import WeightStreamer, stage_parameters_to_stream
from ..plan.plan import Plan
from ..plan.tier_search import TierPlan
from .request import FitRequest
from .start import FitStart


def build_module(model: nn.Module, chain: Chain, placed: TierPlan, request: FitRequest,
                 start: FitStart) -> TierflowModule:
    """The drop-in that runs ``placed``'s plan on ``model`` (cut into ``chain``)."""
    plan = _with_run_notes(placed, request, start)
    depth = 0 if request.config.serial_reads else placed.depth  # read ahead as steps run
    stores = start.stores
    owned = None
    if request.optimizer is not None:
        owned = OwnedOptimizer(chain, request.optimizer,
                               stores[placed.states.name] if placed.states else None,
                               read_ahead=depth > 0)
    streamer = _stream(model, chain, placed, stores)
    host_stages = plan.host_updated_stages  # the Updates the plan runs in host RAM
    if host_stages:
        streamed = frozenset(id(p) for ps in streamer.stage_params.values() for p in ps) \
            if streamer is not None else frozenset()
        owned.step_on_host(HostUpdates(set(host_stages), start.device,
                                       streamer.offloaded if streamer else None, streamed,
                                       read_ahead=depth > 0), request.optimizer)
    host_room = None
    if start.exact_host:  # profiled with exact thresholds; steps cache, and trim where they must
        configure_host_allocator(CACHING_THRESHOLD)
        # malloc's caches stay while the RSS is under the predicted peak: the peak a user
        # measures is then the plan's, and the room the budget leaves stays free
        host_room = HostRoom(placed.predicted_peak + start.outside_budget,
                             ceiling=start.budget + start.outside_budget)
        host_room.guard_prediction()  # at any moment
    deferred = None
    if request.deferred:
        stash = GradientStash(stores[placed.weights.name], streamer.stage_params) \
            if streamer else None
        room = None
        if host_room is not None:  # what the pass adds over the static bytes, at its peak
            growth = placed.update_pass.peak - placed.plan.costs.static_bytes
            room = functools.partial(host_room.make_room, growth, fresh=True)
        deferred = DeferredUpdates(owned, request.grad_accum, request.max_grad_norm,
                                   plan.routines, transfer_to(streamer, owned, gradients=stash),
                                   streamer,
                                   stash, room)
    start.say(f"planned in {time.perf_counter() - start.started:.1f} s: {plan.strategy}")
    tapes = None
    if placed.tapes is not None:
        tapes = TapeOffload(stores[placed.tapes.name],
                            {storage_key(p) for p in model.parameters()})
    boundaries = BoundaryStash(stores[placed.boundaries.name]) if placed.boundaries else None
    return TierflowModule(model, chain, plan, Executors(
        start.autocast, start.device, start.log, owned, streamer, deferred,
        placed.update_pass, tapes, host_room, boundaries))


def _with_run_notes(placed: TierPlan, request: FitRequest, start: FitStart) -> Plan:
    """``placed``'s plan as it runs: with every read on demand under ``serial_reads`` (its
    prediction kept), and the notes of what ``fit`` saw and chose."""
    plan = placed.plan
    if start.came_in_ram:
        note = (f"the model came in RAM with {format_bytes(start.came_in_ram)} of weights, "
                f"above the budget of {format_bytes(start.budget)}: the process held them "
                "before fit moved them to the disk tier; build a model larger than the budget "
                "there (tierflow.load_model(..., disk=DIR))")
        start.say(note)
        plan = replace(plan, notes=plan.notes + (note,))
    if request.config.serial_reads and placed.depth and plan.transfers is not None:
        moves = plan.transfers
        on_demand = replace(moves, weights=moves.weights and replace(moves.weights, depth=0),
                            states=moves.states and replace(moves.states, read_ahead=False),
                            tapes=moves.tapes and replace(moves.tapes, read_ahead=False),
                            boundaries=moves.boundaries and replace(moves.boundaries,
                                                                    read_ahead=False))
        plan = replace(plan.with_transfers(on_demand), notes=plan.notes + (
            f"every read runs on demand (serial_reads): the plan reads {placed.depth} stage(s) "
            "ahead, and its predicted step assumes it",))
    if start.exact_host:
        plan = replace(plan, notes=plan.notes + (
            "malloc keeps freed memory for reuse (no page faults on fresh memory) and gives "
            "it back before an operation only when the RSS plus what the operation adds "
            "would pass the predicted peak",))
    return plan


def _stream(model: nn.Module, chain: Chain, placed: TierPlan,
            stores: dict) -> WeightStreamer | None:
    """Hand the streamed stages' weights to a streamer and bring every other weight of a model
    that starts on a lower tier into memory for good."""
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
        offloaded = OffloadedParameters(stores[placed.weights.name])
        attach(model, offloaded)
    names = {id(p): name for name, p in model.named_parameters()}
    return WeightStreamer(streamed, offloaded, names)
