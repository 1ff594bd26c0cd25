"""Predict a training run on some hardware: analytic costs -> placement -> step time, tok/s, MFU.

``predict(Setup(...))`` is what ``tierflow plan`` prints and ``tierflow sweep`` repeats over
a grid. Nothing is run: the model's shape comes from its config, the machine's rates from a
hardware profile, and the step from the same planners that plan real runs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..plan.placement import place
from ..plan.placement_problem import Link, Placement, Precision, Problem, Tier
from ..precision.config import BytesPerParameter
from .activations import activation_options, with_grad_bytes
from .setup import Setup
from .stages import StepShape, chain_costs, step_flops
from .tiered import tiered_placement


def placement_precision(per: BytesPerParameter) -> Precision:
    """The bytes per parameter of ``per`` as the placement planner counts them
    (``plan/placement_problem.Precision``: the int8 moments' scales among the moments)."""
    return Precision(weights=per.weights, grads=per.gradients, master=per.master,
                     moments=per.moments + per.moment_scales)


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

    def to_json(self) -> str:
        return json.dumps({"format": "tierflow-prediction", "predicted": True, **asdict(self)},
                          indent=1)


def problem_for(setup: Setup) -> Problem:
    """The placement problem of ``setup``: per-stage sizes and times, tiers, links."""
    hw, shape, prec, sel = setup.hardware, setup.shape, setup.run_precision, setup.trains
    per_param = placement_precision(prec.bytes_per_parameter())
    step = StepShape(setup.seq, setup.batch)
    costs = chain_costs(shape, step, prec, hw, selection=setup.selection)
    params = (shape.embed_params(), *[shape.layer_params()] * shape.layers, shape.head_params())
    grads = tuple(int(p * per_param.grads) for p in sel.trainable)
    options = activation_options(with_grad_bytes(costs, (0,) * len(params), 0), with_grads=False)
    if setup.grad_accum == 1:  # gradients appear during the backward, after the forward's peak
        options += activation_options(with_grad_bytes(costs, grads,
                                                      int(sel.tied * per_param.grads)),
                                      with_grads=True)
    disk_read = setup.disk_bw or hw.disk_read_bw
    disk_write = setup.disk_bw or hw.disk_write_bw
    if hw.has_gpu:
        tiers = [Tier("gpu", setup.gpu if setup.gpu is not None else hw.gpu_bytes),
                 Tier("ram", setup.ram)]
        links = [Link(hw.host_link_bw, hw.host_link_bw)]
    else:
        tiers, links = [Tier("ram", setup.ram)], []
    if setup.disk:
        tiers.append(Tier("disk", setup.disk_budget))
        links.append(Link(disk_read, disk_write))
    device_bw = hw.memory_bw * hw.memory_efficiency if hw.has_gpu else \
        hw.update_bw(prec.optim_dtype)
    return Problem(params=params, compute=tuple(s.fwd_time + s.bwd_time for s in costs.stages),
                   precision=per_param, tiers=tuple(tiers), links=tuple(links),
                   activations=options, grad_accum=setup.grad_accum,
                   host_update_bw=hw.update_bw(prec.optim_dtype), device_update_bw=device_bw,
                   runtime_bytes=costs.extra["runtime"], trainable=sel.states(),
                   forward_only=sel.forward_only())


def predict(setup: Setup) -> Prediction:
    """Plan ``setup``; raises PlacementError (a BudgetError) when nothing fits."""
    hw, prec = setup.hardware, setup.run_precision
    if setup.disk and not hw.has_gpu:  # RAM computes, over a disk: the trainer's own search
        placement = tiered_placement(setup)
    else:
        placement = place(problem_for(setup))
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
                      matmul_dtype=prec.matmul_dtype, peak_flops=hw.flops(prec.matmul_dtype))
