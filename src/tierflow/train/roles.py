"""Who does what in a run of ``tierflow train``: the decisions that a run with a disk tier or a
GPU makes differently, each one named rule, here and nowhere else.

``--disk DIR`` names the directory of a disk tier and nothing more. What changes with one
follows from these rules, so the loop reads ``fit_owns_optimizer(opts)`` where it decides
who steps the optimizer, not ``if opts.disk``:

- ``fit_owns_optimizer``: ``tierflow.fit`` owns the optimizer, or the trainer does;
- ``ranks_hold_replicas``: under torchrun, replicas or ZeRO-2 shards;
- ``builds_on_disk``: the model is built onto the disk tier, or in host RAM.

No torch here: the command line applies the first two to its flags before importing torch.
"""
from __future__ import annotations

from typing import Protocol


class RunFlags(Protocol):
    """What the rules read of a run's flags (``options.TrainOptions`` has them); named here so
    that the options, which apply the rules, are not imported by them."""

    disk: str | None  # the disk tier's directory
    gpu: str | None  # the GPU budget


class TierBudgets(Protocol):
    """What ``builds_on_disk`` reads of the compute tier (``device.ComputeTier`` has them)."""

    gpu: int | None  # bytes
    ram: int | None  # bytes


def fit_owns_optimizer(opts: RunFlags) -> bool:
    """Whether ``tierflow.fit`` owns the optimizer (one AdamW per stage, stepped during the
    backward or in a pass right after it; ``owned.FitOwnedOptimizer``) rather than the
    trainer (``optimizer.LocalOptimizer``, or ``distributed.ShardedOptimizer`` under
    torchrun).

    The rule: fit owns it when the run has a disk tier (``--disk DIR``) or a GPU (``--gpu``,
    real or simulated). Both are there to hold what does not fit the compute tier between
    uses: AdamW's states and the weights of the stages that stream, on the disk, or in the
    host RAM below a GPU. Only the executor can step an optimizer whose states are never all
    in memory, reading and writing them back stage by stage as the plan says, or step them
    where they live in host RAM; the trainer's optimizer holds every state on the compute
    device at once, so its plan only reserves room for them. So ``tierflow train`` plans
    exactly the placements ``tierflow plan`` predicts among. (Under torchrun ``--gpu`` is
    refused, so this changes nothing there.)

    What follows, at each place that names this rule: the trainer moves a model it steps
    whole to the compute device (refused first if its weights and states alone pass
    ``--ram``), while fit places and streams a model it steps; the plan counts fit's states
    itself (nothing reserved, no optimizer-step temporaries measured, no ``RAM_HEADROOM``);
    checkpoints are written and read stage by stage; ``--host-updates`` and
    ``--optimizer-states`` place fit's optimizer, so they need it; under torchrun the ranks
    hold replicas (``ranks_hold_replicas``)."""
    # a directory: ``TrainOptions.check_flags`` turns "none" into None
    return bool(opts.disk) or opts.gpu is not None


def ranks_hold_replicas(opts: RunFlags) -> bool:
    """Under torchrun, whether every rank holds the whole model and its optimizer states
    (replicas, each stage's gradients averaged over the ranks before its update) rather than
    a 1/ranks shard of the states (ZeRO-2, ``distributed.ShardedOptimizer``). Replicas
    exactly when fit owns the optimizer: its per-stage optimizers step whole stages, and
    only the trainer's optimizer is sharded. Replicas may round stochastically and keep int8
    moments; shards may not (they need element-wise states without a random stream)."""
    return fit_owns_optimizer(opts)


def builds_on_disk(tier: TierBudgets, weights: int) -> bool:
    """Whether a run with a disk tier builds its model onto it (a module or a tensor at a
    time: never whole in memory) rather than in host RAM. On the CPU, always: the disk is
    where its weights wait for fit's plan. Under a GPU, when its ``weights`` (bytes in the
    precision's dtype) pass ``--ram``; a model built in host RAM whose step then finds too
    little RAM beside it is built again on disk (``loop._train_on``)."""
    return tier.gpu is None or (tier.ram is not None and weights > tier.ram)
