"""Optimizer steps in host RAM, where a streamed stage's weights and states live below a GPU.

When the plan keeps a stage's weights and its optimizer states in the host RAM below a GPU
(real or simulated), bringing the states up for the update and the weights back down after
it moves four times the weights' bytes over the link, or more (AdamW: two moments up and
down, the weights down). Stepping in host RAM moves the gradients down instead: the stage's
optimizer is built over host parameters that are the weights' own copies in the host store
(``HostStore.entry``), so it updates them in place, and the stage's next fetch reads the new
values. One host thread steps the stages in update order (the last stage first), each one
beside the backward of the stages before it; at most one step waits behind the running one,
so host RAM holds the gradients of two stages at most, as the plan counts. With updates
deferred to after the backward (accumulation, clipping) the gradients already wait in host
RAM between micro-batches (``GradientStash``), and the update pass steps them there.
"""
from __future__ import annotations

import torch
from torch import nn

from .copy_stream import SideStreamCopier
from .disk import WriteBehind
from .host_store import HostStore
from .offload import OffloadedParameters
from .trace import span


class HostUpdates:
    """The host side of the stages the optimizer steps in host RAM (``stages``), whose
    weights ``offloaded`` keeps in a ``HostStore``."""

    def __init__(self, offloaded: OffloadedParameters, stages: set[int],
                 device: torch.device) -> None:
        if not isinstance(offloaded.store, HostStore):
            raise TypeError("host updates step weights kept in host RAM (a HostStore)")
        self.offloaded = offloaded
        self.stages = frozenset(stages)
        self._copier = SideStreamCopier(device)
        # one step queued behind the running one: submitting a third waits for the first
        self._steps = WriteBehind("tierflow-host-update", limit=1)

    def twins(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Host parameters sharing memory with ``params``' copies in host RAM: what the
        stage's optimizer is built over."""
        store = self.offloaded.store
        return [nn.Parameter(store.entries(self.offloaded.file_of(p))[0], requires_grad=True)
                for p in params]

    def update(self, i: int, params: list[nn.Parameter], twins: list[nn.Parameter],
               optimizer: torch.optim.Optimizer) -> None:
        """Copy stage i's gradients down to its twins (freeing them on the compute tier),
        then step ``optimizer`` on the host thread."""
        pinned = self._copier.pinned()
        with span(f"gradients down {i}", "disk write"):
            sources = [p.grad for p in params if p.grad is not None]
            grads = [torch.empty(g.shape, dtype=g.dtype, pin_memory=pinned) for g in sources]
            self._copier.copy(grads, sources)
        copies = iter(grads)
        for p, twin in zip(params, twins):
            if p.grad is not None:
                twin.grad = next(copies)
                p.grad = None
        self._steps.submit(i, self._step, i, optimizer, twins, 1.0)

    def update_stashed(self, i: int, twins: list[nn.Parameter], grads: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer, scale: float) -> None:
        """Step ``optimizer`` on the host thread from gradients already in host RAM (stashed
        between micro-batches: ``grads[k]`` is ``twins[k]``'s), times ``scale``."""
        for twin, grad in zip(twins, grads):
            twin.grad = grad
        self._steps.submit(i, self._step, i, optimizer, twins, scale)

    def wait(self) -> None:
        """Until every step has run (and raise a step's error)."""
        self._steps.wait()

    @staticmethod
    def _step(i: int, optimizer: torch.optim.Optimizer, twins: list[nn.Parameter],
              scale: float) -> None:
        with span(f"host update {i}", "optimizer"):
            if scale != 1.0:  # clipping by the global norm
                for twin in twins:
                    if twin.grad is not None:
                        twin.grad.mul_(scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
