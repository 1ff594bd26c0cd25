"""Predict a training run on some hardware: analytic costs -> placement -> step time, tok/s, MFU.

``predict(Setup(...))`` is what ``tierflow plan`` prints and ``tierflow sweep`` repeats over
a grid. Nothing is run: the model's shape comes from its config, the machine's rates from a
hardware profile, and the step from the same planner that plans real runs
(``sim/tiered.py``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..plan.placement import Placement
from .setup import Setup
from .stages import StepShape, step_flops
from .tiered import tiered_placement


@dataclass(frozen=True)
class Prediction:
    model: str
    hardware: str
    seq: int
    batch: int
    grad_accum: int
    precision: str
    params: int
    trainable: int  # the parameters that train (all of them but under --freeze/--train-only)
    selection: str  # the --freeze/--train-only flags that chose them ("" when all train)
    forward_only: int  # stages at the front that nothing trains in or before: no backward
    tokens_per_step: int
    # model FLOPs: 6 x matmul parameters + causal attention when everything trains
    flops_per_token: float
    placement: Placement
    step_time: float
    tokens_per_second: float
    mfu: float  # model FLOP/s over the dense peak of the matmul dtype
    matmul_dtype: str
    peak_flops: float  # the dense peak MFU is measured against
    # where the stages' costs came from (``costs_kind``): "analytic", "measured" or "trainer"
    costs: str = "analytic"

    def to_json(self) -> str:
        return json.dumps({"format": "tierflow-prediction", "predicted": True, **asdict(self)},
                          indent=1)


def predict(setup: Setup, *, smallest_budgets: bool = True) -> Prediction:
    """Plan ``setup`` with the trainer's own search; raises PlacementError (a BudgetError)
    when nothing fits, naming the smallest budget of each tier unless not
    ``smallest_budgets`` (the closest placement's error then: a sweep's cells)."""
    hw, prec = setup.hardware, setup.run_precision
    placement = tiered_placement(setup, smallest_budgets=smallest_budgets)
    step = StepShape(setup.seq, setup.batch)
    tokens = step.tokens * setup.grad_accum
    flops_token = step_flops(setup.shape, step, setup.selection) / step.tokens
    tok_s = tokens / placement.step_time
    return Prediction(model=setup.shape.name, hardware=hw.name, seq=setup.seq,
                      batch=setup.batch, grad_accum=setup.grad_accum,
                      precision=prec.describe(), params=setup.shape.total_params(),
                      trainable=setup.trains.total, selection=setup.trains.given,
                      forward_only=setup.trains.forward_only(),
                      tokens_per_step=tokens, flops_per_token=flops_token,
                      placement=placement, step_time=placement.step_time,
                      tokens_per_second=tok_s,
                      mfu=tok_s * flops_token / hw.flops(prec.matmul_dtype),
                      matmul_dtype=prec.matmul_dtype, peak_flops=hw.flops(prec.matmul_dtype),
                      costs=costs_kind(setup))


def costs_kind(setup: Setup) -> str:
    """Where ``setup``'s costs come from: "analytic" (the shape and the hardware profile),
    "measured" (a one-layer copy run by `tierflow plan --measure`) or "trainer" (what a
    run of `tierflow train` measured here and kept)."""
    if setup.measured is None:
        return "analytic"
    return "trainer" if setup.measured.origin else "measured"
