"""Updates after the backward: gradient accumulation over micro-batches and clipping by the
global gradient norm, for an optimizer tierflow owns.

An update inside the backward (the default) cannot clip by a norm that is only known once
every stage's gradients exist, nor wait for later micro-batches. Here each micro-batch's
backward only completes gradients: a resident stage keeps them in ``.grad``, a streamed
stage hands them to the tier its weights live on (``GradientStash``, moved by the plan's
gradient ops: ``plan/gradient_schedule.py``). After the last micro-batch of a step
the global norm gives the clipping factor (as ``torch.nn.utils.clip_grad_norm_``), and one
pass over the stages, last first, updates each: its weights and gradients are fetched, the
next stages' weights and its optimizer states read ahead (during the update before it), its
weights written back behind it; the stages stepped in host RAM (the pass's first Updates,
which name the host optimizer) are stepped there, on the host thread meanwhile, from their
gradients stashed there (a streamed stage's, read from disk into host RAM by the plan's Load
when stashed on disk) or copied down by the plan's Store (a resident stage's). Under a host RAM budget each stage's update first makes room for
what the pass adds at its peak (``make_room``): malloc's caches from the backward would
otherwise stay resident beside the states and weights the pass reads.
"""
from __future__ import annotations

import math
from typing import Callable

from torch import nn

from ..plan.gradient_schedule import GRADS
from ..plan.ops import TRANSFERS, Op, Store, Transfer, Update
from ..plan.plan import Routines
from .grad_norm import square_norm
from .gradients import GradientStash
from .optimizer import OwnedOptimizer
from .trace import span
from .weights import WeightStreamer

CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class DeferredUpdates:
    """The micro-batch count and the update pass of one fitted module."""

    def __init__(self, optimizer: OwnedOptimizer, grad_accum: int, max_grad_norm: float | None,
                 routines: Routines, transfer: Callable[[Transfer], None],
                 streamer: WeightStreamer | None = None, stash: GradientStash | None = None,
                 make_room: Callable[[], None] | None = None):
        self.optimizer = optimizer
        self.routines = routines  # the plan's update pass, and the reads after it
        self.transfer = transfer  # starts one of their transfer ops
        optimizer.measures_norm = False  # the update pass measures it before any update
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.streamer = streamer
        self.stash = stash
        self.make_room = make_room  # before each stage's update (see HostRoom)
        self.micro = 0  # micro-batches of the current step done so far
        self.last_norm: float | None = None  # the global gradient norm of the last update

    def gradients_complete(self, op: Update) -> None:
        """The plan's Update(i) during a micro-batch: stage i's gradients are complete for
        this micro-batch (a streamed stage's leave with the plan's Store after it, their norm
        measured on the step's last micro-batch)."""
        if self.stash is not None:
            self.stash.measuring = self.micro == self.grad_accum - 1

    def before_backward(self, i: int) -> None:
        """Stage i's gradients of earlier micro-batches, read by the plan's Load, back in
        ``.grad`` to accumulate into."""
        if self.stash is not None:
            self.stash.restore(i)

    def backward_done(self) -> None:
        """A micro-batch ended; after the last one of a step, update every stage. Then the
        reads the next micro-batch starts with."""
        self.micro += 1
        if self.micro < self.grad_accum:
            self._dispatch(self.routines.between)
            return
        self.micro = 0
        self._update_all()
        self._dispatch(self.routines.after_pass)

    def _dispatch(self, transfers: tuple[Op, ...]) -> None:
        for op in transfers:
            self.transfer(op)

    def forget_step(self) -> None:
        """After a step that failed before its update pass: its micro-batches forgotten, the
        gradients stashed on the lower tier too (the caller drops those in ``.grad``)."""
        self.micro = 0
        if self.stash is not None:
            self.stash.forget_all()

    def _update_all(self) -> None:
        stages = [i for i, opt in enumerate(self.optimizer.optimizers) if opt is not None]
        # gradients on disk were measured as they left; those in memory are measured here
        stashed = sum(self.stash.square_norms.values()) if self.stash is not None else 0.0
        in_memory = sum(_square_norm(self.optimizer.stage_params[i]) for i in stages)
        self.last_norm = math.sqrt(stashed + in_memory)
        scale = 1.0
        if self.max_grad_norm is not None:
            scale = min(1.0, self.max_grad_norm / (self.last_norm + CLIP_EPSILON))
        stashed = self.stash.stage_params if self.stash is not None else {}
        streamed = self.streamer.stage_params if self.streamer is not None else {}
        room_made = False  # for the next update and the reads placed before it
        host = self.optimizer.host_stages
        self.optimizer.reuse_buffers()  # until release_buffers after the pass
        for op in self.routines.update_pass:  # last first: the next stages read meanwhile
            if isinstance(op, Update) and op.on_host:  # the host thread steps it meanwhile
                if op.stage in stashed:  # its gradients wait in host RAM (or were read there)
                    params, grads = self.stash.take(op.stage)
                    self.optimizer.step_stashed_on_host(op.stage, params, grads, scale)
                else:  # they stayed on the compute tier: the plan's Store sent them down
                    self.optimizer.step_stage(op.stage, scale, on_host=True)
                continue
            if isinstance(op, Store) and op.what == GRADS:  # a host stage's, sent down
                self.optimizer.dispatch(op)  # (the stash stores none in the pass)
                continue
            if isinstance(op, TRANSFERS) and op.stage in host:  # its gradients, to host RAM
                self.transfer(op)
                continue
            if self.make_room is not None and not room_made:
                self.make_room()
                room_made = True
            if isinstance(op, TRANSFERS):
                self.transfer(op)
                continue
            i = op.stage
            if i in streamed:
                with span("wait for weights", "compute"):
                    self.streamer.wait_loaded(i)
                self.stash.restore(i)  # read by the plan's Load of its gradients
            with span(f"update {i}", "optimizer"):
                self.optimizer.step_stage(i, scale)
            room_made = False
        self.optimizer.wait_host_updates()
        self.optimizer.release_buffers()
        if self.stash is not None:
            self.stash.clear()


def _square_norm(params: list[nn.Parameter]) -> float:
    return square_norm(p.grad for p in params if p.grad is not None)
