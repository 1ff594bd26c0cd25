"""The optimizer of ``tierflow train``, built in one place for one process and for ZeRO shards.

``build_optimizer`` is ``tierflow.precision.make_optimizer``: AdamW with its moments in
``--optim-dtype`` and bf16 weights kept by an fp32 master or by stochastic rounding. With fp32
everything it is ``torch.optim.AdamW``'s arithmetic, op for op. Without ``--disk`` the plan
leaves free what the optimizer holds while it steps after the backward: its own states
(``reserved_bytes``: master copy, moments, int8 scales, from
``PrecisionConfig.bytes_per_parameter`` plus the int8 blocks' padding) and the temporaries of
its step (``step_transient_bytes``: 16 MiB for fp32 weights, 48 MiB for int8 moments).
"""
from __future__ import annotations

from typing import Any

import torch

from ..precision import PrecisionConfig, make_optimizer
from ..precision.config import BLOCK
from .options import TrainOptions

BETAS = (0.9, 0.95)
EPS = 1e-8


def param_groups(params: list, opts: TrainOptions) -> list[dict[str, Any]]:
    """AdamW's param groups: weight decay on matrices only."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": opts.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(groups: list[dict[str, Any]], opts: TrainOptions,
                    precision: PrecisionConfig,
                    generator: torch.Generator | None = None) -> torch.optim.Optimizer:
    """The one place the optimizer is built. Under torchrun the same call builds it over this
    rank's shards of the parameters (``ShardedOptimizer``). The stochastic-rounding stream is
    seeded from ``--seed``, so a run is reproducible and its state travels in checkpoints;
    with --disk every stage's optimizer draws from one ``generator``, saved once."""
    return make_optimizer(groups, precision, lr=opts.lr, betas=BETAS, eps=EPS, seed=opts.seed,
                          generator=generator)


def reserved_bytes(params: list, precision: PrecisionConfig) -> int:
    """Bytes of the optimizer's states for the trainable ``params``: the master copy and the
    moments at ``bytes_per_parameter()``, and for int8 moments each tensor's codes padded to a
    whole block of ``BLOCK`` with one float32 scale per block (the scales are counted per
    block here, so ``moment_scales`` is not added again)."""
    per = precision.bytes_per_parameter()
    total = 0
    for p in params:
        if not p.requires_grad:
            continue
        n = p.numel()
        total += int((per.master + per.moments) * n)
        if precision.optim_dtype == "int8":
            blocks = -(-n // BLOCK)
            total += 2 * (blocks * BLOCK - n + 4 * blocks)  # per moment: padding + scales
    return total


def step_transient_bytes(trainable: list, opts: TrainOptions, precision: PrecisionConfig,
                         device: torch.device) -> int:
    """Bytes the optimizer's step allocates beyond its states, measured on a scratch
    parameter as large as the largest of ``trainable`` up to the slice of CHUNK elements
    tierflow's AdamW updates at a time (a larger parameter needs no more)."""
    from ..exec.memory import meter_for
    from ..profile.optimizer_probe import step_transient
    from ..precision.adamw import CHUNK

    if not trainable:
        return 0
    numel = min(max(p.numel() for p in trainable), CHUNK)
    return step_transient(
        lambda ps: build_optimizer(param_groups(list(ps), opts), opts, precision),
        device, meter_for(device), numel, trainable[0].dtype)


class LocalOptimizer:
    """The single process: the optimizer over the full parameters and torch's global-norm
    clipping, with the interface of ``tierflow.distributed.ShardedOptimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list) -> None:
        self.optimizer = optimizer
        self.params = params

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:  # load_state_dict replaces the list
            group["lr"] = lr

    def micro_batch(self, last: bool) -> None:
        """Nothing to synchronise in one process."""

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return sum(t.nbytes for state in self.optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor))

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
