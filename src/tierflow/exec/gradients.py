"""Gradients of streamed stages between micro-batches, on the tier their weights live on.

With deferred updates (gradient accumulation or clipping by the global norm), a streamed
stage's gradients must outlive its backward without staying in memory. Where and when they
move is the plan's (``plan/gradient_schedule.py``); ``dispatch(op)`` runs one of its
gradient ops: a Store hands stage i's gradients to a writer thread and drops them from
``.grad`` (their squared norm taken as they leave on the last micro-batch of a step, so the
global norm is known when the backward ends); a Load starts reading them back on a reader
thread, after their write (a no-op when none were written: the first micro-batch of a
step). ``restore(i)``, before the stage's backward (autograd then accumulates into them)
and its update, puts what the Load read into ``.grad``. A stage stepped in host RAM takes
its gradients there instead (``take``): where they wait in host RAM, or what the plan's
Load of them into host RAM (``dst="ram"``) read from disk.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import nn

from ..core.errors import TierflowError
from ..plan.ops import Load, Store, Transfer
from .copy_stream import FRESH, CopyAfter
from .disk import DiskStore, WriteBehind
from .grad_norm import square_norm
from .io_threads import transfer_thread
from .trace import span


class GradientStash:
    """The lower tier's copy of the accumulated gradients of ``stage_params``' stages."""

    def __init__(self, store: DiskStore, stage_params: dict[int, list[nn.Parameter]]):
        self.store = store
        self.stage_params = stage_params
        self._writer = WriteBehind("tierflow-grad-write")  # one stage's gradients queued
        self._reader = transfer_thread("tierflow-grad-read")
        self._stashed: dict[int, list[nn.Parameter]] = {}  # stage -> params with grads below
        self._reads: dict[int, Future] = {}  # stage -> the read a Load started
        self.square_norms: dict[int, float] = {}
        self.measuring = False  # the Stores measure the norms (the step's last micro-batch)

    def dispatch(self, op: Transfer) -> None:
        """Run one of the plan's gradient ops: a Store sends stage i's gradients down and
        drops them, a Load starts reading them back."""
        if isinstance(op, Store):
            self._stash(op)
        elif isinstance(op, Load):
            self._load(op)
        else:
            raise ValueError(f"{op}: not a gradient transfer")

    def _stash(self, op: Store) -> None:
        i = op.stage
        params = [p for p in self.stage_params[i] if p.grad is not None]
        grads = [p.grad.contiguous() for p in params]  # here: the copy waits for this point
        for p in params:
            p.grad = None
        if self.measuring:
            self.square_norms[i] = square_norm(grads)
        self._writer.submit(i, self._write, op, grads, self.store.copier.mark())
        self._stashed[i] = params

    def _write(self, op: Store, grads: list[torch.Tensor], after: CopyAfter) -> None:
        with span(str(op), op.resource):
            self.store.write(f"grad-{op.stage}", grads, after)

    def _load(self, op: Load) -> None:
        i = op.stage
        if i not in self._stashed:  # nothing written this step yet
            return
        params = self._stashed.pop(i)
        self._reads[i] = self._reader.submit(self._read, op, params, self._writer.writes.pop(i))

    def _read(self, op: Load, params: list[nn.Parameter],
              written: Future) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        written.result()
        with span(str(op), op.resource):  # into host RAM for a host step, else to compute
            if op.dst == "ram":
                buffers, after = [torch.empty(p.shape, dtype=p.dtype) for p in params], None
            else:  # the side stream's memory: the copy up waits for no kernel
                buffers = [self.store.copier.empty(p.numel() * p.element_size(), p.device)
                           .view(p.dtype).view(p.shape) for p in params]
                after = FRESH
            self.store.read(f"grad-{op.stage}", buffers, after)
        return params, buffers

    def restore(self, i: int) -> None:
        """Put stage i's gradients that the plan's Load read back in ``.grad`` (a no-op when
        none were read); an error when some wait below that no Load read."""
        read = self._reads.pop(i, None)
        if read is None:
            if i in self._stashed:
                raise TierflowError(f"stage {i}'s gradients wait on the lower tier but the plan "
                                    "reads them back nowhere before their use")
            return
        with span(f"wait for gradients {i}", "compute"):
            params, buffers = read.result()
        for p, buffer in zip(params, buffers):
            p.grad = buffer

    def take(self, i: int) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """Stage i's parameters with stashed gradients and those gradients in host RAM, for
        an update run there: where they are in a ``HostStore``, or read there from the disk
        tier by the plan's Load (an error when none did). None of either when the stage
        stashed none."""
        read = self._reads.pop(i, None)
        if read is not None:
            with span(f"wait for gradients {i}", "compute"):
                return read.result()
        if i not in self._stashed:
            return [], []
        if self.store.kind != "ram":
            raise TierflowError(f"stage {i}'s gradients wait on disk but the plan reads them "
                                "into host RAM nowhere before its host step")
        self._writer.writes.pop(i).result()
        return self._stashed.pop(i), self.store.entries(f"grad-{i}")

    def clear(self) -> None:
        """A new step: nothing stashed, no norms."""
        self._stashed.clear()
        self._reads.clear()
        self.square_norms.clear()

    def forget_all(self) -> None:
        """After a step that failed: its writes and reads finished (their errors ignored: the
        step runs again and writes anew), nothing stashed, no norms."""
        for future in (*self._writer.writes.values(), *self._reads.values()):
            future.exception()
        self._writer.writes.clear()
        self.clear()
