"""The ways a micro-batch's activations can fit the compute tier, for the placement planner.

From one chain's costs: keep everything (plain autograd), rotor at a few activation budgets
between its least-memory schedule and keep-all, offloading every stage's tape to the tier
below, and offloading only the stage boundaries while recomputing each stage (checkpoint-all
with the checkpoints elsewhere).
Each is an ``ActivationOption``: its peak and the chain's compute time with it. Pure data:
the same ``simulate`` and ``rotor`` that plan profiled runs price these.
"""
from __future__ import annotations

from dataclasses import replace

from ..plan.costs import ChainCosts
from ..plan.ops import Forward
from ..plan.placement_problem import ActivationOption
from ..plan.rotor import rotor, smallest_budget
from ..plan.simulate import simulate
from ..plan.strategies import checkpoint_all, keep_all

ROTOR_POINTS = 5  # rotor budgets between the least-memory schedule and keep-all
ROTOR_SLOTS = 200
_CACHE: dict[tuple, tuple[ActivationOption, ...]] = {}


def with_grad_bytes(costs: ChainCosts, grads: tuple[int, ...], shared: int) -> ChainCosts:
    """The chain whose stages' parameter gradients are ``grads`` bytes (0: accounted
    elsewhere, e.g. as static bytes when gradients accumulate over micro-batches)."""
    stages = tuple(replace(s, param_bytes=g) for s, g in zip(costs.stages, grads))
    return replace(costs, stages=stages, shared_grad_bytes=shared, static_bytes=0)


def activation_options(costs: ChainCosts, *, with_grads: bool) -> tuple[ActivationOption, ...]:
    """Keep-all, rotor at ``ROTOR_POINTS`` budgets, and boundary offload, for ``costs``
    (cached: a sweep plans the same chain under many budgets)."""
    key = (costs.stages, costs.input_bytes, costs.context_bytes, costs.shared_grad_bytes,
           with_grads)
    if key not in _CACHE:
        _CACHE[key] = _options(costs, with_grads)
    return _CACHE[key]


def _options(costs: ChainCosts, with_grads: bool) -> tuple[ActivationOption, ...]:
    keep = simulate(costs, keep_all(costs))
    options = [ActivationOption("keep", keep.peak, keep.time, with_grads=with_grads)]
    least = smallest_budget(costs)
    seen = set()
    for j in range(ROTOR_POINTS):
        budget = int(least * (keep.peak / least) ** (j / ROTOR_POINTS))
        ops = rotor(costs, budget, slots=ROTOR_SLOTS)
        sim = simulate(costs, ops)
        forwards = sum(1 for op in ops if isinstance(op, Forward))
        if (sim.peak, forwards) in seen or sim.peak >= keep.peak:
            continue
        seen.add((sim.peak, forwards))
        options.append(ActivationOption("recompute", sim.peak, sim.time,
                                        recomputed=forwards - costs.length,
                                        with_grads=with_grads))
    # offload: each tape goes down after its forward and comes back before its backward,
    # two in flight on the compute tier; offload+recompute: only the stage boundaries go
    # down, and each stage is recomputed from its boundary before its backward
    tapes = [s.tape for s in costs.stages]
    options.append(ActivationOption("offload", max(keep.peak - sum(tapes) + 2 * max(tapes), 0),
                                    keep.time, with_grads=with_grads, offload_bytes=sum(tapes)))
    ckpt = simulate(costs, checkpoint_all(costs))
    boundaries = [costs.x_bytes(i) for i in range(1, costs.length)]
    if boundaries:
        peak = ckpt.peak - sum(boundaries) + 2 * max(boundaries)
        options.append(ActivationOption("offload+recompute", max(peak, 0), ckpt.time,
                                        recomputed=costs.length - 1, with_grads=with_grads,
                                        offload_bytes=sum(boundaries)))
    return tuple(options)
