"""Gradients of streamed stages between micro-batches, on the disk tier.

With deferred updates (gradient accumulation or clipping by the global norm), a streamed
stage's gradients must outlive its backward without staying in memory: after the stage's
backward they are written to the disk tier and dropped; before its next backward they are
read back into ``.grad`` (autograd then accumulates into them), and before its update too.
On the last micro-batch of a step each stage's squared gradient norm is taken as it leaves,
so the global norm is known when the backward ends. A stage stepped in host RAM takes its
gradients there instead (``take``): where they wait, or read from disk into host memory.
"""
from __future__ import annotations

import torch
from torch import nn

from .disk import DiskStore, WriteBehind
from .grad_norm import square_norm
from .trace import span


class GradientStash:
    """The disk-tier copy of the accumulated gradients of ``stage_params``' stages."""

    def __init__(self, store: DiskStore, stage_params: dict[int, list[nn.Parameter]]):
        self.store = store
        self.stage_params = stage_params
        self._writer = WriteBehind("tierflow-grad-write")  # one stage's gradients queued
        self._stashed: dict[int, list[nn.Parameter]] = {}  # stage -> params with grads on disk
        self.square_norms: dict[int, float] = {}

    def stash(self, i: int, *, measure: bool) -> None:
        """Send stage i's gradients to disk and drop them (measure their norm on the last
        micro-batch)."""
        params = [p for p in self.stage_params[i] if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if measure:
            self.square_norms[i] = square_norm(grads)
        self._writer.submit(i, self._write, i, grads)
        self._stashed[i] = params

    def _write(self, i: int, grads: list[torch.Tensor]) -> None:
        with span(f"write gradients {i}", "disk write"):
            self.store.write(f"grad-{i}", [g.contiguous() for g in grads])

    def restore(self, i: int) -> None:
        """Put stage i's stashed gradients back in ``.grad`` (a no-op when none are)."""
        if i not in self._stashed:
            return
        self._writer.writes.pop(i).result()
        params = self._stashed.pop(i)
        with span(f"read gradients {i}", "disk read"):
            buffers = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]
            self.store.read(f"grad-{i}", buffers)
        for p, buffer in zip(params, buffers):
            p.grad = buffer

    def take(self, i: int) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """Stage i's parameters with stashed gradients and those gradients in host RAM, for
        an update run there: where they are in a ``HostStore``, read into host memory from
        the disk tier. None of either when the stage stashed none."""
        if i not in self._stashed:
            return [], []
        self._writer.writes.pop(i).result()
        params = self._stashed.pop(i)
        if self.store.kind == "ram":
            return params, self.store.entries(f"grad-{i}")
        with span(f"read gradients {i}", "disk read"):
            grads = [torch.empty(p.shape, dtype=p.dtype) for p in params]  # in host RAM
            self.store.read(f"grad-{i}", grads)
        return params, grads

    def clear(self) -> None:
        """A new step: nothing stashed, no norms."""
        self._stashed.clear()
        self.square_norms.clear()

    def forget_all(self) -> None:
        """After a step that failed: its writes finished (their errors ignored: the step
        runs again and writes anew), nothing stashed, no norms."""
        for future in self._writer.writes.values():
            future.exception()
        self._writer.writes.clear()
        self.clear()
