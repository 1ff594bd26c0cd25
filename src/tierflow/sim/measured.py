"""``tierflow plan --measure``: the chain's costs measured on this machine, as ``fit`` measures
them before it plans, instead of priced from the model's shape and the calibrated rates.

The analytic costs (``stages.py``) price every layer from rates that ``tierflow calibrate``
measured on one probe layer; a model of another width runs at other rates (W2's layer took
1.7 s forward and backward in the trainer's profile against 0.96 s priced), and its memory
is measured nowhere. Here a copy of the model with one decoder layer (random weights) runs
through the trainer's own profiler (``profile/profiler.py``) on a sample of the planned
shape, under the run's autocast and malloc settings; every decoder layer is then priced at
that layer. The optimizer's rates come from the probe ``fit`` runs (``profile/
optimizer_probe.py``) of tierflow's AdamW in the run's precision. The planner then places
exactly as the trainer does (``tiered.py``). Only this machine can be measured: ``--hardware
cpu``. torch is imported when this runs.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any

import torch

from ..chain import to_chain
from ..core.config import FitConfig
from ..core.errors import TierflowError
from ..exec.context import AutocastMode, untouched
from ..exec.memory import (
    ALLOCATOR_SLACK,
    EXACT_THRESHOLD,
    HostMeter,
    caching_allocator,
    configure_host_allocator,
    return_free_memory,
)
from ..fitting.profile_step import large_head_chunk_fits
from ..models.load import build_random
from ..plan.costs import ChainCosts
from ..plan.measured import Measured
from ..plan.tier_candidates import UpdateRates
from ..plan.tier_search import LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK
from ..precision import make_optimizer
from ..profile.optimizer_probe import probe_numel, probe_optimizer
from ..profile.profiler import Measuring, held_inputs, profile_chain
from .setup import Setup
from .shapes import model_config

# config fields whose layers differ from one another: one measured layer cannot price them
MIXED_LAYERS = ("first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers")


def measure(spec: str, setup: Setup) -> Measured:
    """Measure the model ``spec`` (a preset or a directory with config.json) for ``setup``:
    its chain's costs for each LM-head chunk the trainer would try under ``setup.ram``, and
    the update rates of tierflow's AdamW in ``setup``'s precision."""
    prec = setup.run_precision
    dtype = torch.bfloat16 if prec.model_dtype == "bf16" else torch.float32
    model = _one_layer_model(spec, dtype)
    # the batch `tierflow train` plans a step for (train/packing.planning_sample): its ids'
    # values do not change what the step costs
    window = torch.zeros(setup.batch, setup.seq + 1, dtype=torch.long)  # (batch, seq + 1)
    sample = {"input_ids": window[:, :-1], "shift_labels": window[:, 1:]}
    autocast = AutocastMode("cpu", prec.regime == "autocast", torch.bfloat16)
    if setup.ram is not None:
        configure_host_allocator(EXACT_THRESHOLD)  # as fit measures under a RAM budget
    meter = HostMeter()
    return_free_memory()
    before = meter.current()
    large_fits = large_head_chunk_fits(model, sample, setup.ram, 0, lambda note: None)
    chunks = (LARGE_HEAD_CHUNK, SMALL_HEAD_CHUNK) if large_fits else (SMALL_HEAD_CHUNK,)
    costs = {chunk: _chain_costs(model, sample, autocast, chunk, setup, meter, before)
             for chunk in chunks}
    return Measured(costs, _update_rates(setup, dtype, meter))


def _one_layer_model(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM ``spec`` describes with its first decoder layer alone, random weights."""
    config = copy.deepcopy(model_config(spec))
    mixed = [name for name in MIXED_LAYERS if getattr(config, name, None)]
    kinds = getattr(config, "layer_types", None)
    if mixed or (kinds and len(set(kinds)) > 1):
        reason = ", ".join(mixed) or f"layer_types {sorted(set(kinds))}"
        raise TierflowError(f"--measure prices every decoder layer of --model {spec} at its "
                            f"first, but its layers differ ({reason}): leave --measure out")
    config.num_hidden_layers = 1
    if kinds:
        config.layer_types = kinds[:1]
    return build_random(config, dtype=dtype, seed=0)


def _chain_costs(model: torch.nn.Module, sample: dict, autocast: AutocastMode, chunk: int,
                 setup: Setup, meter: HostMeter, before: int) -> ChainCosts:
    """The costs of the whole model's chain with LM-head chunks of ``chunk`` tokens: the
    one-layer model's stages measured (``fit``'s profile: the same repeats, the same timing
    allocator), its decoder layer repeated for every layer of ``setup.shape``; static: the
    whole model's parameters and what the runs left resident since ``before`` (as ``fit``
    counts its runtime)."""
    with autocast():
        chain = to_chain(model, sample, head_chunk_tokens=chunk)
        x0, ctx = chain.split_inputs(**sample)
    config = FitConfig()
    timing = functools.partial(caching_allocator, setup.ram) if setup.ram is not None else None
    with untouched(model, torch.device("cpu")):
        measuring = Measuring.of(config, meter, timing)
        (embed, layer, head), shared = profile_chain(chain, x0, ctx, autocast, measuring)
    return_free_memory()
    runtime = max(0, meter.current() - before)
    layers = [replace(layer, name=f"layers.{i}") for i in range(setup.shape.layers)]
    input_bytes, context_bytes = held_inputs(x0, ctx)
    params = _parameter_bytes(setup)
    allocator = ALLOCATOR_SLACK if setup.ram is not None else 0  # as fit plans a RAM budget
    return ChainCosts(stages=(embed, *layers, head), input_bytes=input_bytes,
                      context_bytes=context_bytes, static_bytes=params + runtime + allocator,
                      shared_grad_bytes=shared,
                      extra={"parameters": params, "runtime": runtime, "allocator": allocator,
                             "head chunk": chunk,
                             "source": "measured here (one decoder layer, every layer "
                                       "priced at it)", "autocast": autocast.describe()})


def _parameter_bytes(setup: Setup) -> int:
    width = 2 if setup.run_precision.model_dtype == "bf16" else 4
    return setup.shape.total_params() * width


def _update_rates(setup: Setup, dtype: torch.dtype, meter: HostMeter) -> UpdateRates:
    """The update rates ``fit`` probes (``fitting/tiers.update_rates``), of tierflow's AdamW
    in ``setup``'s precision on the CPU."""
    def factory(params: Any) -> torch.optim.Optimizer:
        return make_optimizer([{"params": list(params)}], setup.run_precision, lr=1e-4)

    numel = probe_numel(setup.ram, setup.trains.total)
    probe = probe_optimizer(factory, torch.device("cpu"), meter, numel, dtype)
    return UpdateRates(probe.state_per_byte, probe.seconds_per_byte, probe.transient_per_byte,
                       probe.transient_bytes, None)
