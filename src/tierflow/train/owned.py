"""``tierflow train --disk``: the optimizer that ``tierflow.fit`` owns, seen by the loop.

With a disk tier, tierflow owns the optimizer (one AdamW per stage, updated during the
backward or in a pass after the last micro-batch; see ``exec/optimizer.py``) so that weights
and optimizer states can live on disk between uses. The loop still talks to the interface
of ``optimizer.LocalOptimizer``; this class provides it: the learning rate, the gradient
norm the update measured, and checkpoints.

Checkpoints hold the single-process format (one ``state_dict()`` over all parameters, the
decay group first, as ``LocalOptimizer`` and the ZeRO shards write it), so a run may resume
with or without ``--disk``. Stochastic rounding (bf16 moments, bf16 weights without a
master) draws from ``RoundingStreams``: one generator on the compute device that every
stage stepped there shares, the format's one ``generator``, and below a GPU one in host RAM
for the stages stepped there (``--host-updates``), saved beside it as ``host_generator``.
The stages draw in update order (the last stage first), so a --disk run rounds with other
random numbers than an in-memory one; resumed in the same mode it continues bit for bit.
They are written and read one stage at a time: the states of a model larger than the RAM
budget never exist in memory at once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .checkpoint import Checkpoint
from .optimizer import param_groups
from .options import TrainOptions

_NAME = re.compile(r"^opt\.0\.state\.(\d+)\.(.+)$")  # flatten_optimizer_states' names


@dataclass(frozen=True)
class RoundingStreams:
    """The stochastic-rounding generators of the per-stage optimizers: ``device`` for the
    stages stepped on the compute device, ``host`` (a CPU generator) for those stepped in
    host RAM below a GPU, over host twins of their parameters."""
    device: torch.Generator
    host: torch.Generator
    model_params: frozenset[int]  # ids of the model's parameters

    @classmethod
    def seeded(cls, device: torch.device, seed: int, model: nn.Module) -> "RoundingStreams":
        streams = cls(torch.Generator(device=device), torch.Generator(device="cpu"),
                      frozenset(id(p) for p in model.parameters()))
        streams.reseed(seed)
        return streams

    def reseed(self, seed: int) -> None:
        """Both streams from the start (``seed``, and ``seed + 1`` for the host's): at the
        run's start and again after fit's optimizer probe drew from them."""
        self.device.manual_seed(seed)
        self.host.manual_seed(seed + 1)

    def for_params(self, params: list[nn.Parameter]) -> torch.Generator:
        """The generator an optimizer over ``params`` draws from: ``host`` for tensors in host
        RAM below a GPU, that is on another device than ``device``'s or, below a simulated
        GPU (where both are the CPU), other than the model's own parameters (their twins)."""
        if params[0].device.type != self.device.device.type:
            return self.host
        if self.device.device.type == "cpu" and not all(id(p) in self.model_params
                                                        for p in params):
            return self.host
        return self.device


class FitOwnedOptimizer:
    """The per-stage optimizers of a fitted module, with ``LocalOptimizer``'s interface.
    A module re-planned after an out-of-memory error (``with_plan``) shares the optimizers,
    the streamer and the update pass of ``module``, so this one serves it too."""

    def __init__(self, module: Any, params: list[nn.Parameter], opts: TrainOptions,
                 rounding: RoundingStreams):
        self.module = module
        self.owned = module.optimizer
        self.rounding = rounding
        order = [p for group in param_groups(params, opts) for p in group["params"]]
        self._global = {id(p): k for k, p in enumerate(order)}  # single-process index
        self._group_sizes = [len(g["params"]) for g in param_groups(params, opts)]
        # per stage: its optimizer's local index -> the single-process index
        self._local = [[self._global[id(p)] for group in param_groups(ps, opts)
                        for p in group["params"]] for ps in self.owned.stage_params]
        self._where = {g: (i, k) for i, indices in enumerate(self._local)
                       for k, g in enumerate(indices)}
        self._cached: tuple[int, dict] | None = None

    # ------------------------------------------------------------------ the loop's interface

    def set_lr(self, lr: float) -> None:
        self.owned.set_lr(lr)

    def micro_batch(self, last: bool) -> None:
        """Nothing to do: the module counts its micro-batches."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The norm the updates measured (they clipped by ``max_norm`` already, as planned)."""
        norm = self.module.last_grad_norm
        return float(norm) if norm is not None else float("nan")

    def step(self) -> None:
        """Nothing to do: every stage was updated during or right after the backward."""

    def zero_grad(self) -> None:
        """Nothing to do: the module drops its gradients (``abandon_step``)."""

    def state_bytes(self) -> int:
        return self.owned.state_bytes()

    # ------------------------------------------------------------------ checkpoints

    def settle(self) -> None:
        """Wait until every weight and state transfer is done (before reading them)."""
        self.module.settle()

    def skeleton(self) -> dict:
        """The single-process ``state_dict()`` with meta tensors for the states (their shapes
        and dtypes): what ``materialize`` fills in, stage by stage, while it is written."""
        groups: list[dict] = []
        state: dict[int, dict] = {}
        rounds = False  # whether the stages draw from the stochastic-rounding streams
        for i, opt in enumerate(self.owned.optimizers):
            if opt is None:
                continue
            local = opt.state_dict()
            rounds = rounds or "generator" in local
            if not groups:
                groups = [{k: v for k, v in g.items() if k != "params"}
                          for g in local["param_groups"]]
            on_disk = self.owned.offloaded_shapes(i)
            for k, values in local["state"].items():
                state[self._local[i][k]] = {
                    key: _placeholder(*on_disk[(k, key)]) if (k, key) in on_disk else value
                    for key, value in values.items()}
        start = 0
        for group, size in zip(groups, self._group_sizes):
            group["params"] = list(range(start, start + size))
            start += size
        full = {"state": state, "param_groups": groups}
        if rounds:
            full["generator"] = self.rounding.device.get_state()
            if self.owned.host_stages:
                full["host_generator"] = self.rounding.host.get_state()
        return full

    def materialize(self, name: str, placeholder: torch.Tensor) -> torch.Tensor:
        """The values of ``name`` (``opt.0.state.<index>.<key>``), reading its stage's states
        when it is the first of them to be written."""
        match = _NAME.match(name)
        if match is None:
            return placeholder
        i, k = self._where[int(match[1])]
        if self._cached is None or self._cached[0] != i:
            self._cached = None  # one stage in memory at a time
            self._cached = (i, self.owned.stage_state_dict(i))
        return self._cached[1]["state"][k][match[2]]

    def finished_writing(self) -> None:
        self._cached = None

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """Each stage's states from the checkpoint (single-process format), one at a time."""
        if ckpt.optimizer is None:
            return
        full = ckpt.optimizer.references()[0]  # tensor names in place of tensors
        groups = full["param_groups"]
        streams = {key: ckpt.optimizer.read(value) if isinstance(value, str) else value
                   for key in ("generator", "host_generator")
                   if (value := full.get(key)) is not None}
        if "generator" in streams and "host_generator" not in streams:
            # written without stages in host RAM: they start their stream where it is
            streams["host_generator"] = self.rounding.host.get_state()
        for i, opt in enumerate(self.owned.optimizers):
            if opt is None:
                continue
            local: dict[int, dict] = {}
            for k, g in enumerate(self._local[i]):
                if g in full["state"]:
                    local[k] = {key: ckpt.optimizer.read(value) if isinstance(value, str)
                                else value for key, value in full["state"][g].items()}
            sizes = [len(group["params"]) for group in opt.param_groups]
            start, local_groups = 0, []
            for group, size in zip(groups, sizes):
                local_groups.append({**group, "params": list(range(start, start + size))})
                start += size
            stage = {"state": local, "param_groups": local_groups}
            key = "host_generator" if i in self.owned.host_stages else "generator"
            if streams:
                stage["generator"] = streams[key]
            self.owned.load_stage_state(i, stage)


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
