"""Where ``fit`` puts what it owns when tierflow owns the optimizer, from what it measured:
the profiled chain, a probe of the optimizer and the bandwidth of each lower tier. The
placement itself is ``plan/tier_search.py``'s (pure data, shared with ``tierflow plan``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..chain.base import Chain
from ..core.config import FitConfig
from ..exec import boundaries as boundary_stash
from ..exec import tapes as tape_offload
from ..exec.disk import DiskStore
from ..exec.host_store import HostStore
from ..exec.memory import meter_for
from ..exec.offload import OffloadedParameters
from ..exec.optimizer import stage_owned_parameters
from ..exec.stage_call import storage_key
from ..exec.storage import TensorStore
from ..exec.weights import stage_parameters_to_stream
from ..plan.costs import ChainCosts
from ..plan.tier_candidates import TierProblem, UpdateRates
from ..plan.tier_costs import LowerTier
from ..plan.tier_search import TierPlan, place_on_tiers
from ..profile.machine import copy_bandwidth, disk_free_bytes, disk_tier_bandwidth
from ..profile.optimizer_probe import probe_numel, probe_optimizer

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def update_rates(params: Iterable[nn.Parameter], optimizer: OptimizerFactory,
                 device: torch.device, meter: Any, budget: int | None,
                 lower: list[LowerTier], room: int | None = None) -> UpdateRates:
    """What the optimizer's updates cost, from probes of it on scratch parameters of the
    trainable ``params``' dtype: on the compute tier and, where host RAM is a tier below a
    GPU, in that RAM (simulated: the same CPU, so the same rate, and on the cores that
    compute, so hidden behind nothing). ``fit`` measures them once,
    whatever number of plans it makes (a probe of a large model takes seconds: 4M and 16M
    elements stepped). The probe's scratch parameters are sized within the compute tier's
    ``budget`` and the ``room`` it leaves free now (``probe_numel``)."""
    trainable = [p for p in params if p.requires_grad]
    dtype = trainable[0].dtype if trainable else torch.float32
    model_numel = sum(p.numel() for p in trainable)
    probe = probe_optimizer(optimizer, device, meter, probe_numel(budget, model_numel, room),
                            dtype)
    host_rate = None  # the optimizer in the host RAM below a GPU (simulated: the same CPU)
    if any(t.name == "ram" for t in lower):
        host_rate = probe.seconds_per_byte if device.type == "cpu" else probe_optimizer(
            optimizer, torch.device("cpu"), meter_for(torch.device("cpu")),
            probe_numel(None, model_numel), dtype).seconds_per_byte
    return UpdateRates(probe.state_per_byte, probe.seconds_per_byte, probe.transient_per_byte,
                       probe.transient_bytes, host_rate,
                       host_shares_compute=host_rate is not None and device.type == "cpu")


def place(costs: ChainCosts, chain: Chain, rates: UpdateRates, budget: int | None,
          tiers: PlacedTiers) -> TierPlan:
    """Plan with the optimizer's states on the compute tier or on each lower tier, and with
    the weights of the largest stages (or all) streamed from a lower tier too, its updates
    priced at ``rates`` (``update_rates``), under ``budget`` on the compute tier."""
    trainable = [p for p in chain_parameters(chain) if p.requires_grad]
    problem = TierProblem(
        costs=costs, rates=rates,
        largest=tuple(max((p.nbytes for p in st.parameters() if p.requires_grad), default=0)
                      for st in chain.stages),
        trainable=sum(p.nbytes for p in trainable),
        streamable=tuple(stage_parameters_to_stream(chain.stages)),
        lower=tuple(tiers.lower), weights_tiers=tiers.weights_from,
        deferred=tiers.deferred, accumulates=tiers.micro_batches > 1,
        micro_batches=tiers.micro_batches,
        min_tape_bytes=tape_offload.MIN_BYTES, min_boundary_bytes=boundary_stash.MIN_BYTES,
        host_updatable=host_updatable(chain),
        updated=tuple(i for i, params in enumerate(stage_owned_parameters(chain)) if params))
    return place_on_tiers(problem, budget, tiers.config, tiers.tier)


@dataclass(frozen=True)
class PlacedTiers:
    """What ``place`` plans over besides the costs: the compute ``tier``'s name, the
    ``lower`` tiers, those the weights may stream from (``weights_from``; None: any: a model
    built on a tier streams from it), whether updates are deferred to a pass after the
    backward (``deferred``), the micro-batches of an optimizer step, and the config."""

    tier: str
    lower: tuple[LowerTier, ...]
    weights_from: tuple[LowerTier, ...] | None
    deferred: bool
    micro_batches: int
    config: FitConfig


def host_updatable(chain: Chain) -> tuple[int, ...]:
    """The stages whose updates may run in host RAM: those that own trainable parameters."""
    return tuple(i for i, params in enumerate(stage_owned_parameters(chain)) if params)


def lower_tiers(device: torch.device, disk: str | Path | None, ram: int | None,
                host_tier: bool, offloaded: OffloadedParameters | None
                ) -> tuple[list[LowerTier], dict[str, TensorStore]]:
    """The tiers below the compute tier, nearest first, with their bandwidths measured (host
    RAM under a GPU, real or simulated, less the unused end of its page-locked heap, then the
    disk directory when one is given), and the store of each, by the tier's name (the model's
    own where it starts there)."""
    tiers, stores = [], {}
    if host_tier:
        below = "the GPU" if device.type != "cpu" else "the simulated GPU"
        own = offloaded is not None and offloaded.store.kind == "ram"  # the model starts there
        store = offloaded.store if own else HostStore(device)
        link = copy_bandwidth(device)  # up; the copy down runs at about the same rate
        tiers.append(LowerTier("ram", link, link, ram,
                               f"host RAM (the tier below {below})",
                               heap_slack=store.unused_bytes_bound))
        stores["ram"] = store
    if disk is not None:
        same = offloaded is not None and offloaded.store.kind == "disk" and \
            Path(offloaded.store.directory) == Path(disk)
        store = offloaded.store if same else DiskStore(disk, device=device)
        # its budget: the file system's free space and what the model already keeps there
        budget = disk_free_bytes(store.directory) + (store.bytes if same else 0)
        tiers.append(LowerTier("disk", *disk_tier_bandwidth(store.directory), budget,
                               f"the disk tier ({store.directory})"))
        stores["disk"] = store
    return tiers, stores


def chain_parameters(chain: Chain) -> list[nn.Parameter]:
    """Every parameter of the chain once, in stage order."""
    seen: dict[int, nn.Parameter] = {}
    for stage in chain.stages:
        for p in stage.parameters():
            seen.setdefault(storage_key(p), p)
    return list(seen.values())
