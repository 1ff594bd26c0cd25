"""The chain as one autograd node, so that the wrapped model is a drop-in."""
from __future__ import annotations

from typing import Any

import torch

from .runner import StepRun


class RunPlan(torch.autograd.Function):
    """The chain as one autograd node: forward runs the plan's forward ops, backward the rest."""

    @staticmethod
    def forward(fctx: Any, run: StepRun, x0: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        fctx.run = run
        return run.forward_phase(x0).detach()

    @staticmethod
    def backward(fctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        run: StepRun = fctx.run
        del fctx.run
        return None, run.backward_phase(grad_out), None
