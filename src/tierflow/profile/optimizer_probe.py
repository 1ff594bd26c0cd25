"""What an optimizer costs, measured before planning: the bytes of state it keeps per byte of
parameter, its seconds per byte, and the temporaries one step allocates (``probe_optimizer``),
from a few steps on scratch parameters on the compute device."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ..exec.memory import DeviceMeter, HostMeter, return_free_memory
from ..exec.optimizer import OptimizerFactory
from .machine import Quiet, device_model, keep, recalled
from .tensor_ledger import TensorLedger

PROBE_SECONDS = 0.05  # the least time the probe's measured steps take
# a probe's temporaries grow with its parameter when 4x the elements take more than this
# many times the bytes: tierflow's AdamW took 1.0x to 1.33x (int8 moments: 48.5 MiB for a
# 16 MiB parameter, a slice of it, and 64.5 for 64 MiB, its most), torch's 1.45x to 4x.
# At 2x, the rule before, torch's AdamW was priced as 8 MiB fixed in some fits and 2 bytes
# per byte in others: 8 MiB apart for an 8 MiB parameter.
GROWING = 1.4
# ... or when they grow by more than this many bytes per byte of parameter between the two
# steps: a 1 MiB step's temporaries swing with the state of malloc's heap (torch's AdamW in
# fit's probe: benchmarks/smallest_budget_spread.py), which can hide a growth of 2 bytes
# per byte from the ratio; tierflow's AdamW grows by a third of a byte per byte beyond its
# slice (48.5 to 64.5 MiB from 16 to 64 MiB)
GROWTH_PER_BYTE = 0.5

PROBE_SHARE = 4  # the probe's larger step takes at most 1/PROBE_SHARE of the budget...
ROOM_SHARE = 2  # ... and 1/ROOM_SHARE of what the budget leaves free when it runs
# the probe's peak per element of its larger step: parameter, gradient, moments, a master
# copy and temporaries, fp32 but for the parameter and its gradient (measured for tierflow's
# AdamW with fp32 or bf16 weights: about 24 bytes, beyond some 75 MiB that a process's first
# optimizer step allocates whatever its size)
PROBE_BYTES_PER_ELEMENT = 24
PROBE_NUMEL = (1 << 18, 1 << 22)  # its elements, at least (1 MiB fp32) and at most...
# ... but for a budget's room too small for the least: then this, whose larger step (4x, 1 MiB
# of bf16) has tensors of EXACT_THRESHOLD and more, each in a mapping of its own that the RSS
# sees exactly; below it they share malloc's heap, and a probe of 22K elements priced torch's
# AdamW at 2 to 8.5 bytes per byte from one fit to the next (a smallest budget 1-2 MiB apart)
PROBE_LEAST = 1 << 17



@dataclass(frozen=True)
class OptimizerProbe:
    state_per_byte: float  # optimizer state bytes per parameter byte
    seconds_per_byte: float  # step time per parameter byte
    transient_per_byte: float  # extra bytes during a step, per byte of the largest parameter
    transient_bytes: int = 0  # extra bytes during a step, whatever the parameter's size


@dataclass(frozen=True)
class _Step:
    state: int  # bytes
    seconds: float
    transient: int  # bytes: the meter's peak (on the host the RSS's, with the process's noise)
    nbytes: int  # of the parameter
    tensors: int  # bytes: the peak of the step's own tensors (on a device: ``transient``)


def probe_optimizer(factory: OptimizerFactory, device: torch.device, meter: HostMeter | DeviceMeter,
                    numel: int = 1 << 22, dtype: torch.dtype = torch.float32) -> OptimizerProbe:
    """Run the optimizer on scratch parameters of ``numel`` and 4 x ``numel`` elements of
    the model's ``dtype`` (bf16 weights bring an fp32 master copy) to learn its state size,
    its speed and the temporaries one step allocates. Temporaries that grow with the
    parameter are priced per byte of it, at the larger step's rate; ones that do not (an
    optimizer that works through a parameter a slice at a time, as tierflow's AdamW does)
    as fixed bytes, the larger of the two measured. Only the larger step prices growing
    temporaries: the smaller one's vary with the state of malloc's heap (torch's AdamW: 2 to
    5.5 MiB for 1 MiB, against a steady 8 MiB for 4 MiB). Each size is stepped twice, on
    fresh parameters, and the lower peak kept: the heap's swings only ever add.

    On the host the per-byte price is that of the step's own tensors (``_Step.tensors``),
    and what the RSS added beyond them is priced as fixed bytes: that excess is the rest of
    the process (a few MiB whatever the parameter's size), and priced per byte it grew with
    the largest parameter: a 31 MiB head's update moved by 14 MiB between fresh processes
    (``benchmarks/smallest_budget_spread.py``). The seconds per byte are the ones kept on
    this machine when there are (``_kept_rate``), as a stage's times are."""
    with Quiet() as quiet:
        small, large = (min((_probe_step(factory, device, meter, n, dtype) for _ in range(2)),
                            key=lambda step: step.transient) for n in (numel, 4 * numel))
    state_per_byte = large.state / large.nbytes
    seconds_per_byte = _kept_rate(large.seconds / large.nbytes,
                                  _rate_key(factory, device, numel, dtype), quiet.quiet)
    more = large.nbytes - small.nbytes
    if not (_grows(small.transient, large.transient, more)
            or _grows(small.tensors, large.tensors, more)):
        # the counted step's tensors too: it runs unfused (``fused_adamw.fused_step``), as a
        # stage too small for the compiled kernel does, with a workspace the timed steps lack
        return OptimizerProbe(state_per_byte, seconds_per_byte, 0.0,
                              max(small.transient, large.transient, small.tensors,
                                  large.tensors))
    if 2 * large.tensors < large.transient:  # mostly outside torch's tensors: the RSS's rate
        return OptimizerProbe(state_per_byte, seconds_per_byte, large.transient / large.nbytes)
    return OptimizerProbe(state_per_byte, seconds_per_byte, large.tensors / large.nbytes,
                          max(0, large.transient - large.tensors))


def _rate_key(factory: OptimizerFactory, device: torch.device, numel: int,
              dtype: torch.dtype) -> str:
    """The key of an optimizer's kept seconds per byte: its class and the settings that
    change the work of a step (the flags of its defaults and its own plain settings, such as
    tierflow's AdamW's moment dtype; not the values of its hyperparameters: a learning rate
    changes no work), the device, the probe's size and dtype."""
    optimizer = factory([nn.Parameter(torch.zeros(1, device=device, dtype=dtype))])
    settings = {**optimizer.defaults, **{k: v for k, v in vars(optimizer).items()
                                         if not k.startswith("_")}}
    flags = sorted((k, str(v)) for k, v in settings.items()
                   if isinstance(v, (bool, int, str)) or v is None)
    return (f"{type(optimizer).__module__}.{type(optimizer).__qualname__}|{flags}|"
            f"{device_model(device)}|{numel}|{dtype}")


def _kept_rate(measured: float, key: str, quiet: bool) -> float:
    """The seconds per byte kept for ``key`` on this machine (``profile/machine.py``'s kept
    figures), else ``measured``, kept when other processes left the CPUs quiet."""
    rate = recalled("optimizer", key)
    if isinstance(rate, (int, float)) and rate > 0:
        return float(rate)
    if quiet:
        keep("optimizer", key, measured)
    return measured


def _grows(small: int, large: int, more_bytes: int) -> bool:
    """Whether temporaries of ``small`` and ``large`` bytes, measured on parameters
    ``more_bytes`` apart, grow with the parameter (``GROWING``, ``GROWTH_PER_BYTE``)."""
    return large > GROWING * small or large - small > GROWTH_PER_BYTE * more_bytes


def step_transient(factory: OptimizerFactory, device: torch.device,
                   meter: HostMeter | DeviceMeter, numel: int, dtype: torch.dtype) -> int:
    """The bytes one step of ``factory``'s optimizer allocates beyond its states and the
    gradient, measured on a scratch parameter of ``numel`` elements of ``dtype``: what an
    optimizer the caller steps after the backward needs on top of its states."""
    return _probe_step(factory, device, meter, numel, dtype).transient


def _probe_step(factory: OptimizerFactory, device: torch.device,
                meter: HostMeter | DeviceMeter, numel: int, dtype: torch.dtype) -> _Step:
    """State bytes, seconds and temporaries of one step on a parameter of ``numel``."""
    probe = nn.Parameter(torch.zeros(numel, device=device, dtype=dtype))
    opt = factory([probe])
    probe.grad = torch.full_like(probe, 1e-3)
    opt.step()  # creates the state
    state = sum(t.nbytes for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.numel() > 1)
    if device.type == "cpu":  # else the step's first free may trim free memory left by
        return_free_memory()  # earlier work, and the RSS would fall by more than it adds
    base = meter.current()
    meter.reset_peak()
    start = time.perf_counter()
    rounds = 0
    # at least PROBE_SECONDS of steps: a host meter samples the RSS every half millisecond,
    # and three steps of a 1 MiB parameter (a millisecond each) let it miss the peak of
    # their temporaries in some runs (1.0 to 4.4 MiB measured for torch's AdamW)
    while rounds < 3 or (time.perf_counter() - start < PROBE_SECONDS and rounds < 100):
        opt.step()
        meter.finish()
        rounds += 1
    seconds = (time.perf_counter() - start) / rounds
    transient = max(0, meter.peak() - base)
    tensors = transient  # a device's allocator counts tensors alone
    if isinstance(meter, HostMeter):  # one more step, its tensors counted (and not timed)
        with TensorLedger(device.type) as ledger:
            opt.step()
        tensors = ledger.peak
    return _Step(state, seconds, transient, probe.nbytes, tensors)


def probe_numel(budget: int | None, model_numel: int | None = None,
                room: int | None = None) -> int:
    """Elements of the optimizer probe's smaller step (its larger one has 4x): no more than
    make the larger step the size of a model of ``model_numel`` trainable elements (a small
    model's updates are priced at its own size, not at 16M elements'), between PROBE_NUMEL's
    bounds, and as many as keep its peak within 1/PROBE_SHARE of ``budget`` and 1/ROOM_SHARE
    of ``room``, the bytes the budget leaves free when it runs, below the lower bound too:
    it runs before the plan, and the process's high-water mark is what a RAM budget is
    checked against (sized to the budget alone, whatever was in use, and with the lower
    bound above it, the probe took `tierflow compare --quick` 2-7% past its 64 MiB budget
    before its steps ran)."""
    low, high = PROBE_NUMEL
    if model_numel is not None:
        high = max(low, min(high, -(-model_numel // 4)))
    for bytes_, share in ((budget, PROBE_SHARE), (room, ROOM_SHARE)):
        if bytes_ is not None:
            high = min(high, max(PROBE_LEAST, bytes_ // share // (4 * PROBE_BYTES_PER_ELEMENT)))
    return high
