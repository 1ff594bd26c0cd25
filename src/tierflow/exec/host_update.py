"""Optimizer steps in host RAM, where a stage's optimizer states live below a GPU (or on the
disk below that RAM).

When the plan keeps a stage's optimizer states in the host RAM below a GPU (real or
simulated), bringing them up for the update and back after it moves four times the weights'
bytes over the link (AdamW in fp32: two moments up and down), and a streamed stage's
updated weights go down too. Stepping in host RAM moves the gradients down instead
(ZeRO-Offload's division of work): the plan's Store of them to host RAM, after the stage's
backward or before its Update in a deferred pass, runs here (``send_down``); a stage's
gradients stashed on disk come up to host RAM by the plan's Load of them
(``GradientStash``). States on the disk tier come to host RAM for the step
and go back after it, as ZeRO-Infinity's NVMe offload does: the owner of the states
(``OwnedOptimizer``) gives each step the two halves of that move, and host RAM holds three
stages' states at most: the one stepping, the next one read, the last one being written.
The stage's optimizer is built over host parameters, its twins: for a weight streamed from
host RAM, the weight's own copy in the host store (``HostStore.entries``), which the step
updates in place and the stage's next fetch reads; for a weight streamed from disk, a host
parameter that is empty between steps: the weight's file is read into a host buffer as the
stage is handed over (on a reader thread, while the host steps the stage before it; without
read-ahead by the host thread before the step), and the host thread writes it back after the
step (ZeRO-Infinity's parameters on NVMe, stepped by the CPU), so that the stage's next
fetch reads the new file; for a weight that stays on the compute
tier, a host copy of its own, whose new values the host thread copies up after the step.
The stages it steps are those whose ``Update`` ops the plan runs on the host optimizer
(``Plan.host_updated_stages``); each such op hands its stage over (``OwnedOptimizer.
step_update``, or the deferred pass). One host thread steps them in update order (the last
stage first), each one beside
the backward of the stages before it; at most one step waits behind the running one, so
host RAM holds the gradients of two stages at most, as the plan counts. With updates
deferred to after the backward (accumulation, clipping) a streamed stage's gradients
already wait in host RAM between micro-batches (``GradientStash``), and the update pass
steps them there; from disk, the plan's Load reads them into host RAM first.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import nn

from ..core.errors import TierflowError
from ..plan.ops import HOST_OPTIMIZER, Store
from .buffers import BufferPool
from .copy_stream import SideStreamCopier
from .disk import WriteBehind
from .io_threads import transfer_thread
from .offload import OffloadedParameters
from .trace import span


class HostUpdates:
    """The host side of the stages the optimizer steps in host RAM (``stages``); the weights
    of ``streamed`` (parameter ids) live in ``offloaded``'s store (host RAM or disk) between
    uses."""

    def __init__(self, stages: set[int], device: torch.device,
                 offloaded: OffloadedParameters | None = None,
                 streamed: frozenset[int] = frozenset(), read_ahead: bool = False) -> None:
        if streamed and offloaded is None:
            raise TypeError("streamed weights stepped in host RAM need their OffloadedParameters")
        self.stages = frozenset(stages)
        self.offloaded = offloaded
        self.streamed = streamed
        self._copier = SideStreamCopier(device)
        # one step queued behind the running one: submitting a third waits for the first
        self._steps = WriteBehind("tierflow-host-update", limit=1)
        self._uploads: dict[int, list[tuple[nn.Parameter, nn.Parameter]]] = {}
        # stage -> (twin, its weight's file, the twin's empty tensor) for weights on disk
        self._from_disk: dict[int, list[tuple[nn.Parameter, str, torch.Tensor]]] = {}
        self._down: dict[int, dict[int, torch.Tensor]] = {}  # stage -> param id -> gradient
        self._weights_pool = BufferPool()  # host RAM for the weights of the stage stepping
        self._weight_reads: dict[int, Future] = {}  # stage -> its weights' read, ahead
        self._reader = transfer_thread("tierflow-host-weights-read") \
            if read_ahead else None

    def twins(self, i: int, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Stage i's host parameters, one per parameter of ``params``: what its optimizer
        is built over (see the module docstring)."""
        out = []
        for p in params:
            if id(p) in self.streamed and self.offloaded.store.kind == "disk":
                empty = torch.empty(p.shape, dtype=p.dtype)
                empty.untyped_storage().resize_(0)
                twin = nn.Parameter(empty)
                self._from_disk.setdefault(i, []).append((twin, self.offloaded.file_of(p), empty))
            elif id(p) in self.streamed:
                twin = nn.Parameter(self.offloaded.store.entries(self.offloaded.file_of(p))[0])
            else:
                copy = torch.empty(p.shape, dtype=p.dtype, pin_memory=self._copier.pinned())
                self._copier.copy([copy], [p.detach()])
                twin = nn.Parameter(copy)
                self._uploads.setdefault(i, []).append((twin, p))
            out.append(twin)
        return out

    def send_down(self, op: Store, params: list[nn.Parameter]) -> None:
        """Run the plan's Store of stage i's gradients to host RAM (``op``): copy those of
        ``params`` down, for its host step, and free them on the compute tier."""
        i = op.stage
        down = [p for p in params if p.grad is not None]
        with span(str(op), op.resource):
            grads = [torch.empty(p.grad.shape, dtype=p.grad.dtype,
                                 pin_memory=self._copier.pinned()) for p in down]
            self._copier.copy(grads, [p.grad for p in down])
        for p in down:
            p.grad = None
        self._down[i] = {id(p): grad for p, grad in zip(down, grads)}

    def sent_down(self, i: int) -> list[torch.Tensor]:
        """Stage i's gradients that a Store sent down and no step took yet."""
        return list(self._down.get(i, {}).values())

    def update(self, i: int, params: list[nn.Parameter], twins: list[nn.Parameter],
               optimizer: torch.optim.Optimizer, scale: float = 1.0,
               stashed: dict[int, torch.Tensor] | None = None,
               fetch: Callable[[], None] | None = None,
               release: Callable[[], None] | None = None) -> None:
        """Give stage i's twins their gradients, then step ``optimizer`` on the host thread
        with them times ``scale``, between ``fetch`` (its states into host RAM, from disk)
        and ``release`` (them back). A gradient in ``stashed`` (by parameter id) waited in
        host RAM already; the others came down by the plan's Store of them (``send_down``):
        an error if one is still on the compute tier."""
        stashed = stashed or {}
        down = self._down.pop(i, {})
        for p, twin in zip(params, twins):
            if id(p) in stashed:
                twin.grad = stashed[id(p)]
            elif id(p) in down:
                twin.grad = down[id(p)]
            elif p.grad is not None:
                raise TierflowError(f"stage {i}'s gradients are on the compute tier but the "
                                    "plan copies them down nowhere before its host step")
        if self._reader is not None and i in self._from_disk:  # read while the step before runs
            self._weight_reads[i] = self._reader.submit(self._read_weights, i)
        self._steps.submit(i, self._step, i, optimizer, twins, scale, fetch, release)

    def wait(self) -> None:
        """Until every step has run and sent its weights up (and raise a step's error)."""
        self._steps.wait()

    def _step(self, i: int, optimizer: torch.optim.Optimizer, twins: list[nn.Parameter],
              scale: float, fetch: Callable[[], None] | None,
              release: Callable[[], None] | None) -> None:
        if fetch is not None:
            with span(f"wait for optimizer states {i}", HOST_OPTIMIZER):
                fetch()
        weights = self._weights_in(i)
        with span(f"Uh({i})", HOST_OPTIMIZER):  # the plan's op, on its resource
            if scale != 1.0:  # clipping by the global norm
                for twin in twins:
                    if twin.grad is not None:
                        twin.grad.mul_(scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if release is not None:
            release()
        if weights is not None:
            self._weights_out(i, weights)
        uploads = self._uploads.get(i)
        if uploads:
            with span(f"weights up {i}", "disk read"):
                self._copier.copy([p.detach() for _, p in uploads],
                                  [twin.detach() for twin, _ in uploads])

    def _weights_in(self, i: int) -> torch.Tensor | None:
        """Stage i's weights that live on disk in its twins: read ahead, or read now;
        returns the pool buffer they are in (None when none of its weights is on disk)."""
        entries = self._from_disk.get(i)
        if not entries:
            return None
        pending = self._weight_reads.pop(i, None)
        flat, views = pending.result() if pending is not None else self._read_weights(i)
        for (twin, _, _), view in zip(entries, views):
            twin.data = view
        return flat

    def _read_weights(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(pool buffer, one view of it per twin of stage i), read from the weights' files."""
        entries = self._from_disk[i]
        with span(f"read weights {i} for its host step", "disk read"):
            flat, views = self._weights_pool.views([(twin.shape, twin.dtype)
                                                    for twin, _, _ in entries])
            for (_, key, _), view in zip(entries, views):
                self.offloaded.store.read(key, [view])
        return flat, views

    def _weights_out(self, i: int, flat: torch.Tensor) -> None:
        """Write stage i's stepped weights back to their files (which its next fetch reads),
        then empty its twins and give their buffer back."""
        with span(f"write weights {i} after its host step", "disk write"):
            for twin, key, empty in self._from_disk[i]:
                self.offloaded.store.write(key, [twin.detach()])
                twin.data = empty
        self._weights_pool.give(flat)
