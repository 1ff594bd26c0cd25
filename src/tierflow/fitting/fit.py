"""``tierflow.fit``: a model, a sample and a budget in; a drop-in module that trains the same
parameters with the same gradients inside the budget out. It reads as its four steps:
check the request, start the model where its weights wait, profile and plan the step, and
build what runs the plan (``fitting/``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..core.config import FitConfig
from ..exec.module import TierflowModule
from .build import build_module
from .kernel_limit import hold_to_budget
from .profile_step import profile_and_place
from .request import FitRequest, OptimizerFactory, check_model
from .start import start_fit


def fit(model: nn.Module, sample: Any, *, ram: int | str | None = None,
        gpu: int | str | None = None, planner: str = "auto",
        optimizer: OptimizerFactory | None = None, disk: str | Path | None = None,
        reserve: int | str = 0, grad_accum: int = 1, max_grad_norm: float | None = None,
        config: FitConfig | None = None, verbose: bool = False,
        baseline: int | None = None) -> TierflowModule:
    """Plan ``model``'s training step for ``sample`` under the budgets and return a drop-in.

    ``sample`` is what you call the model with: a tensor, a tuple of arguments or a dict of
    keyword arguments (``{"input_ids": ..., "labels": ...}`` for Hugging Face models).
    Budgets are bytes or strings like ``"2GiB"`` and cover everything the step holds on that
    tier: parameters, gradients, optimizer states (when tierflow owns the optimizer) and
    activations. Call ``fit`` under the same autocast mode you will train with.
    ``optimizer`` is a factory such as ``lambda ps: torch.optim.AdamW(ps, lr=1e-4)``; it is
    called once per stage, and updates then happen during ``backward()``. Without it, step
    your own optimizer and give the bytes it holds while it steps as ``reserve`` (its states,
    AdamW's 2x the fp32 parameter bytes, and the temporaries of its step): the plan leaves
    them free on the compute tier. ``disk`` is a directory for
    the disk tier: when the optimizer's states do not fit the budget beside the rest, they
    live there between updates, and so do the weights of the stages that do not fit
    (streamed in ahead of their use); with ``ram=`` too, a model in RAM moves to the disk
    tier before it is profiled, one stage's weights in memory at a time (as ``tierflow
    train --disk`` builds one there), and the stages that do not stream come back for good.
    Parameters with ``requires_grad`` False take no gradient and no optimizer state; the
    stages that hold them stream them like the others. Under ``gpu=``, a model on the CPU
    with a sample on the GPU is never whole on the GPU: its weights wait in host RAM, or on
    disk when it was loaded there (``tierflow.load_model(..., disk=DIR)``), and come up as
    the plan says.
    With ``optimizer=``, ``grad_accum`` (micro-batches per update: call ``backward()`` that
    many times, on losses divided by it as in plain PyTorch) and ``max_grad_norm`` (clip
    by the global norm, as ``torch.nn.utils.clip_grad_norm_``) move the updates to one pass
    after the last micro-batch's backward; ``last_grad_norm`` then gives the norm. Without
    it, ``grad_accum`` > 1 says that your optimizer steps after that many backwards: the
    gradients then live for the whole step, and the plan holds them as static bytes.
    A RAM budget covers the process's RSS above what it held when ``fit`` began, less the
    model's parameters; with ``baseline`` (bytes of RSS, e.g. right after the imports, as
    ``tierflow.cli.measure`` and ``tierflow train`` measure a peak) it covers the RSS above that,
    and what the process holds above it before ``fit`` (the model's objects, the kernels'
    first-use caches) is planned as static bytes, "held before fit".
    """
    request = FitRequest(ram=ram, gpu=gpu, optimizer=optimizer, disk=disk, reserve=reserve,
                         grad_accum=grad_accum, max_grad_norm=max_grad_norm, config=config,
                         verbose=verbose, baseline=baseline, planner=planner)
    check_model(model, sample)
    start = start_fit(model, sample, request)  # the tiers, and where the weights wait
    chain, placed, measured = profile_and_place(model, sample, request, start)
    module = build_module(model, chain, placed, request, start)
    module.measured = measured
    hold_to_budget(request, start)  # under FitConfig(enforce=True): the kernel holds the budget
    return module
