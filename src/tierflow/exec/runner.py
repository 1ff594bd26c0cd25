"""Run one step of a Plan on real tensors. The runner only reads the plan: it holds exactly
the values the plan says, frees what the plan frees, and accounts every byte it holds."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..chain.base import Chain, stateful_modules
from ..core.errors import TierflowError
from ..plan.ops import (
    TRANSFERS,
    Backward,
    Fetch,
    Forward,
    Free,
    Op,
    Stash,
    Store,
    Transfer,
    Update,
    stage_of,
)
from .boundaries import BoundaryStash
from .context import AutocastMode, BufferState, RngState, replay_buffers, replay_rng
from .stage_call import (
    Taped,
    backward_taped,
    context_tensors,
    forward_plain,
    forward_taped,
    storage_key,
)
from .tapes import TapeOffload
from .trace import mark_micro_batch, span
from .weights import WeightStreamer


class Ledger:
    """Bytes of activations and input gradients the runner holds, by storage, so that
    aliases count once; parameters (static, accounted by the planner) are left out."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters = parameters
        self.peak = 0
        self.current = 0

    def measure(self, tensors: list[torch.Tensor], saved: dict[int, int]) -> int:
        held = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
        held.update(saved)
        self.current = sum(n for key, n in held.items() if key not in self.parameters)
        self.peak = max(self.peak, self.current)
        return self.current


@dataclass
class StepHooks:
    """What a step's run holds and calls besides the chain, each optional: the owned
    optimizer's ``update(op)`` for an Update op (run where ``op.resource`` says), the ``ledger`` of bytes held, the weights'
    ``streamer`` (which the plan's transfers go to), ``before_backward(i)`` (e.g. earlier
    micro-batches' gradients back), ``backward_done()`` (e.g. the deferred update pass),
    the ``tapes`` offloaded to a lower tier, ``before_op(position)`` (e.g. making host RAM
    room for that op), the ``boundaries`` Stash(i) puts x[i] in until Fetch(i), and
    ``transfer(op)``, which starts a transfer op where it moves (the streamer, the
    optimizer's states)."""

    update: Callable[[Update], None] | None = None
    ledger: Ledger | None = None
    streamer: WeightStreamer | None = None
    before_backward: Callable[[int], None] | None = None
    backward_done: Callable[[], None] | None = None
    tapes: TapeOffload | None = None
    before_op: Callable[[int], None] | None = None
    boundaries: BoundaryStash | None = None
    transfer: Callable[[Transfer], None] | None = None


class StepRun:
    """The state of one step: x[i] references, tapes, input gradients, RNG states."""

    def __init__(self, chain: Chain, ops: Sequence[Op], forward_count: int,
                 device: torch.device, hooks: StepHooks):
        self.chain = chain
        self.ops = ops
        self.forward_count = forward_count
        self.device = device
        self.ctx: dict[str, Any] = {}  # the step's side inputs, given with ``inputs``
        self.autocast: AutocastMode | None = None
        self.update = hooks.update
        self.ledger = hooks.ledger
        self.streamer = hooks.streamer
        self.before_backward = hooks.before_backward
        self.backward_done = hooks.backward_done
        self.tape_offload = hooks.tapes
        self.before_op = hooks.before_op
        self.boundaries = hooks.boundaries
        self.transfer = hooks.transfer
        self.x: dict[int, torch.Tensor] = {}
        self.tapes: dict[int, Taped] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.rng: dict[int, RngState] = {}
        self.buffers: dict[int, BufferState] = {}
        self.input_requires_grad = False
        backwards = {op.stage for op in ops if isinstance(op, Backward)}
        self.input_grads = {i + 1 for i in backwards}  # x[i] whose gradient the plan uses
        self.forward_only = min(backwards, default=0)  # stages before it: no backward
        # per op, the compute op it prepares: itself, or for a transfer the next compute op
        # (room is made for that op before the transfers placed before it start)
        self._serves: list[int | None] = [None] * len(ops)
        upcoming = None
        for position in range(len(ops) - 1, -1, -1):
            if not isinstance(ops[position], TRANSFERS):
                upcoming = position
            self._serves[position] = upcoming
        self._prepared = -1  # the last compute op room was made for
        self._dispatched = 0  # ops run so far (the transfers before the first, at ``begin``)

    def begin(self) -> None:
        """Start the transfers placed before the first compute op (the inputs may need the
        first stage's weights: the HF adapter's embedding)."""
        mark_micro_batch()
        while self._dispatched < len(self.ops) and isinstance(self.ops[self._dispatched],
                                                               TRANSFERS):
            self._run(self._dispatched)
            self._dispatched += 1

    def inputs(self, ctx: dict[str, Any], autocast: AutocastMode) -> None:
        """The step's context (side inputs) and the autocast mode its stages run under."""
        self.ctx, self.autocast = ctx, autocast

    def forward_phase(self, x0: torch.Tensor) -> torch.Tensor:
        """Run the ops up to the chain output; returns x[L]."""
        if x0.requires_grad and self.forward_only:
            raise TierflowError(
                f"the input requires grad, but the plan runs stages 0 to {self.forward_only - 1}"
                " forward only (they train nothing, and fit's sample did not require grad): "
                "give fit a sample whose input requires grad")
        self.x[0] = x0
        self.input_requires_grad = x0.requires_grad
        if self.boundaries is not None:
            self.boundaries.reset()
        for position in range(self._dispatched, self.forward_count):
            self._run(position)
        return self.x[len(self.chain)]

    def backward_phase(self, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Run the remaining ops from the output's gradient; returns the input's gradient."""
        self.grads[len(self.chain)] = grad_out
        for position in range(self.forward_count, len(self.ops)):
            self._run(position)
        self.x.clear()
        if self.boundaries is not None:
            self.boundaries.reset()
        if self.backward_done is not None:
            self.backward_done()
        return self.grads.pop(0, None)

    def _run(self, position: int) -> None:
        op = self.ops[position]
        serves = self._serves[position]
        if self.before_op is not None and serves is not None and serves > self._prepared:
            self.before_op(serves)
            self._prepared = serves
        if isinstance(op, TRANSFERS):
            self.transfer(op)
            return
        i = stage_of(op)
        if self.streamer is not None and i in self.streamer.stage_params:
            with span("wait for weights", "compute"):
                self.streamer.wait_loaded(i)
                if isinstance(op, Update):  # a kept stage's last write reads them
                    self.streamer.wait_stored(i)
        if isinstance(op, Forward):
            with span(str(op), "compute"):
                store = self.tape_offload.take_armed(i) if self.tape_offload else None
                self._forward(op.stage, op.tape, store, op.selective)
        elif isinstance(op, Backward):
            if self.before_backward is not None:
                self.before_backward(op.stage)
            with span(str(op), "compute"):
                self._backward(op.stage)
        elif isinstance(op, Free):
            self._drop(op.index)
        elif isinstance(op, Stash):
            self.boundaries.stash(op.index, self.x.pop(op.index))
        elif isinstance(op, Fetch):
            with span(f"wait for x{op.index}", "compute"):
                self.x[op.index] = self.boundaries.fetch(op.index)
        elif isinstance(op, Update):
            assert self.update is not None, "plan updates parameters but no optimizer is owned"
            with span(str(op), "compute"):
                self.update(op)  # on the compute tier or handed to the host optimizer
        if self.ledger is not None:
            self._account()

    def _drop(self, i: int) -> None:
        """The plan's reference to x[i] is gone, in memory or stashed."""
        self.x.pop(i, None)
        if self.boundaries is not None:
            self.boundaries.forget(i)

    def _forward(self, i: int, tape: bool, offload: Store | None = None,
                 selective: bool = False) -> None:
        """x[i+1] from x[i]; with ``tape`` keep stage i's tape, sent down by ``offload``, or
        only its matmul and attention outputs when ``selective``."""
        stage = self.chain.stages[i]
        x = self.x[i] if i in self.x else self.tapes[i].xin.detach()
        self.x.pop(i + 1, None)  # a recomputation replaces the previous x[i+1]
        first = i not in self.rng
        if first:
            self.rng[i] = RngState.capture(self.device)
            mutated = stateful_modules(stage)
            if mutated:
                self.buffers[i] = BufferState(mutated)
        replay = contextlib.nullcontext() if first else replay_rng(self.rng[i])
        with replay, replay_buffers(None if first else self.buffers.get(i)):
            if tape:  # x[i] needs a gradient when the plan backpropagates stage i - 1
                input_grad = i in self.input_grads if i > 0 else self.input_requires_grad
                hooks = self.tape_offload.hooks(offload) if offload else None
                try:
                    taped = forward_taped(stage, x, self.ctx, self.autocast,
                                          input_grad=input_grad, offload=hooks,
                                          selective=selective)
                finally:
                    if offload:  # its last pack of small saved tensors goes down now
                        self.tape_offload.finish(offload)
                self.tapes[i] = taped
                self.x[i + 1] = taped.y.detach()
            else:
                self.x[i + 1] = forward_plain(stage, x, self.ctx, self.autocast)

    def _backward(self, i: int) -> None:
        taped = self.tapes.pop(i)
        grad_y = self.grads.pop(i + 1)
        grad_x = backward_taped(taped, grad_y)
        del taped, grad_y
        self._drop(i + 1)
        if i > 0:
            self._drop(i)
        if grad_x is not None:
            self.grads[i] = grad_x

    def _account(self) -> None:
        length = len(self.chain)  # grad[L] is the caller's, not ours
        held = list(self.x.values()) + [g for i, g in self.grads.items() if i < length]
        held += context_tensors(self.ctx)
        saved: dict[int, int] = {}
        for taped in self.tapes.values():
            held += [taped.xin, taped.y]
            saved.update(taped.saved)
        self.ledger.measure(held, saved)
