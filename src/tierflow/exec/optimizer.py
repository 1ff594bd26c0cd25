"""Optimizers tierflow owns: one per stage, stepped as soon as that stage's gradients are
complete, so that gradients never all exist at once."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from ..chain.base import Chain
from .disk import DiskStore
from .memory import DeviceMeter, HostMeter
from .stage_call import storage_key

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_EVICTED = torch.empty(0)  # stands in for a state tensor that lives on disk


class OwnedOptimizer:
    """Stage i's optimizer holds the parameters whose last gradient comes from stage i's
    backward: a parameter used by several stages (tied embeddings) belongs to the first.

    With a ``disk`` store, each stage's optimizer states live on the disk tier between
    updates: read into fresh buffers just before the stage's update, written back after.
    """

    def __init__(self, chain: Chain, factory: OptimizerFactory, disk: DiskStore | None = None):
        owner: dict[int, int] = {}
        params: dict[int, nn.Parameter] = {}
        for i, stage in enumerate(chain.stages):
            for p in stage.parameters():
                if p.requires_grad:
                    key = storage_key(p)
                    owner[key] = min(owner.get(key, i), i)
                    params[key] = p
        self.stage_params: list[list[nn.Parameter]] = [[] for _ in chain.stages]
        for key, i in owner.items():
            self.stage_params[i].append(params[key])
        self.optimizers: list[torch.optim.Optimizer | None] = [
            factory(ps) if ps else None for ps in self.stage_params]
        self.disk = disk
        self._offloaded: list[list[tuple[dict, str, torch.Size, torch.dtype]]] = [
            [] for _ in chain.stages]

    def step_stage(self, i: int) -> None:
        opt = self.optimizers[i]
        if opt is None:
            return
        self._fetch(i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._evict(i)

    def state_dict(self) -> list[dict | None]:
        """Every stage's optimizer state, read back from disk where it lives there."""
        states = []
        for i, opt in enumerate(self.optimizers):
            if opt is None:
                states.append(None)
                continue
            self._fetch(i)
            states.append(copy.deepcopy(opt.state_dict()))
            self._evict(i)
        return states

    def _fetch(self, i: int) -> None:
        """Put stage i's offloaded states back in its optimizer, read from disk."""
        entries = self._offloaded[i]
        if not entries:
            return
        buffers = [torch.empty(shape, dtype=dtype) for _, _, shape, dtype in entries]
        self.disk.read(f"optimizer-{i}", buffers)
        for (state, key, _, _), buffer in zip(entries, buffers):
            state[key] = buffer
        entries.clear()

    def _evict(self, i: int) -> None:
        """Write stage i's state tensors to disk and drop them from RAM (a no-op without disk)."""
        if self.disk is None:
            return
        entries = self._offloaded[i]
        tensors = []
        for p in self.stage_params[i]:
            state = self.optimizers[i].state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    entries.append((state, key, value.shape, value.dtype))
                    tensors.append(value.contiguous())
        self.disk.write(f"optimizer-{i}", tensors)
        for state, key, _, _ in entries:
            state[key] = _EVICTED

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = lr


@dataclass(frozen=True)
class OptimizerProbe:
    state_per_byte: float  # optimizer state bytes per parameter byte
    seconds_per_byte: float  # step time per parameter byte
    transient_per_byte: float  # extra bytes during a step, per byte of the largest parameter


def probe_optimizer(factory: OptimizerFactory, device: torch.device, meter: HostMeter | DeviceMeter,
                    numel: int = 1 << 22) -> OptimizerProbe:
    """Run the optimizer on a scratch parameter to learn its state size, speed and the
    temporaries one step allocates."""
    probe = nn.Parameter(torch.zeros(numel, device=device))
    opt = factory([probe])
    probe.grad = torch.full_like(probe, 1e-3)
    opt.step()  # creates the state
    state = sum(t.nbytes for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.numel() > 1)
    rounds = 3
    base = meter.current()
    meter.reset_peak()
    start = time.perf_counter()
    for _ in range(rounds):
        opt.step()
    seconds = (time.perf_counter() - start) / rounds
    transient = max(0, meter.peak() - base)
    nbytes = probe.nbytes
    return OptimizerProbe(state / nbytes, seconds / nbytes, transient / nbytes)
