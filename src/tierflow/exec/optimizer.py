"""Optimizers tierflow owns: one per stage, stepped as soon as that stage's gradients are
complete, so that gradients never all exist at once."""
from __future__ import annotations

import copy
import functools
import math
from concurrent.futures import Future
from typing import Callable, Iterable

import torch
from torch import nn

from ..chain.base import Chain
from ..core.errors import TierflowError
from ..plan.gradient_schedule import GRADS
from ..plan.ops import Load, Store, Transfer, Update
from .buffers import BufferPool
from .copy_stream import FRESH, CopyAfter
from .disk import DiskStore, WriteBehind
from .grad_norm import square_norm
from .host_update import HostUpdates
from .io_threads import transfer_thread
from .stage_call import storage_key
from .trace import span

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_EVICTED = torch.empty(0)  # stands in for a state tensor that lives on disk


class OwnedOptimizer:
    """Stage i's optimizer holds the parameters whose last gradient comes from stage i's
    backward: a parameter used by several stages (tied embeddings) belongs to the first.

    With a ``disk`` store, each stage's optimizer states live on the disk tier between
    updates, moved by the plan's Load and Store ops of states (``dispatch``): read on an I/O
    thread while the update before runs (or right before their own, without read-ahead),
    written back on another after it; two stages' states besides the one updating.
    States read back live in buffers of a pool on the parameters' device (the GPU's when they
    wait in host RAM below it), given back once they are written again. The stages
    ``step_on_host`` hands over are stepped in host RAM instead (exec/host_update.py): their
    states stay there, or, on the disk tier, are read into a host pool for the host thread's
    step (the read starts as the stage is handed over, while the host steps the stage handed
    over before it) and written back after it. Only that thread touches a host stage's
    states while its step is queued; the main thread starts their read only as it hands the
    stage over. Both threads hand writes to the one writer, whose queue both bound.
    """

    def __init__(self, chain: Chain, factory: OptimizerFactory, disk: DiskStore | None = None,
                 read_ahead: bool = True):
        self.stage_params = stage_owned_parameters(chain)
        self.optimizers: list[torch.optim.Optimizer | None] = [
            factory(ps) if ps else None for ps in self.stage_params]
        self.disk = disk
        self.read_ahead = read_ahead
        self._offloaded: list[list[tuple[dict, str, torch.Size, torch.dtype]]] = [
            [] for _ in chain.stages]
        self._reader = transfer_thread("tierflow-state-read")
        self._writer = WriteBehind("tierflow-state-write")  # one stage's states queued
        self._reads: dict[int, Future] = {}
        device = next((p.device for ps in self.stage_params for p in ps), torch.device("cpu"))
        # states come back to where they update; below a GPU into the side stream's memory
        # (a buffer given back was last used before its states' write was dispatched)
        self._pool = BufferPool(device=device, allocate=None if disk is None else
                                functools.partial(disk.copier.empty, device=device))
        self._host_pool = BufferPool()  # ... in host RAM, for the stages stepped there
        self._flat: dict[int, torch.Tensor] = {}  # stage -> the pool buffer its states view
        owned = [j for j, opt in enumerate(self.optimizers) if opt is not None]
        self._first_update = owned[-1] if owned else -1
        self._square_norm: float | None = None
        self._measured: set[int] = set()  # stages whose norm their gradients' Store took
        self.measures_norm = True  # off when a deferred update pass measures it first
        self.host: HostUpdates | None = None
        self._twins: dict[int, list[nn.Parameter]] = {}
        self.updates = 0  # stage updates begun since the start: a step with any is not rerun

    def step_on_host(self, host: HostUpdates, factory: OptimizerFactory) -> None:
        """From now on the optimizer of each of ``host.stages`` steps in host RAM, over
        ``host.twins`` of its parameters (built afresh by ``factory``: no step ran yet)."""
        self.host = host
        for i in sorted(host.stages):
            self._twins[i] = host.twins(i, self.stage_params[i])
            self.optimizers[i] = factory(self._twins[i])

    @property
    def host_stages(self) -> frozenset[int]:
        """The stages stepped in host RAM."""
        return frozenset(self._twins)

    def step_stashed_on_host(self, i: int, params: list[nn.Parameter],
                             grads: list[torch.Tensor], scale: float) -> None:
        """Step stage i in host RAM, its gradients times ``scale``: deferred updates' pass,
        where ``grads[k]``, ``params[k]``'s, waited in host RAM between micro-batches (any
        other gradient of the stage is copied down)."""
        self.updates += 1
        self._step_on_host(i, scale, {id(p): grad for p, grad in zip(params, grads)})

    def step_update(self, op: Update) -> None:
        """Run the plan's ``op``: step its stage where the op says (the compute tier, or
        the host optimizer in host RAM)."""
        self.step_stage(op.stage, on_host=op.on_host)

    def step_stage(self, i: int, scale: float = 1.0, *, on_host: bool = False) -> None:
        """Update stage i's parameters from their gradients times ``scale`` (clipping), then
        free the gradients: on the compute tier, or ``on_host`` handed to the host
        optimizer (an error unless the plan's host stages were handed to ``step_on_host``)."""
        if i == self._first_update:  # a step's updates begin (the last stage first)
            self.reuse_buffers()
        opt = self.optimizers[i]
        if opt is None:
            return
        if on_host != (i in self._twins):
            raise TierflowError(f"the plan steps stage {i} "
                                f"{'in host RAM' if on_host else 'on the compute tier'}, but "
                                "this optimizer was built to step it "
                                f"{'on the compute tier' if on_host else 'in host RAM'}: run "
                                "it with the plan it was built for")
        self.updates += 1
        if i in self._measured:  # as its gradients went down
            self._measured.discard(i)
        else:
            self._measure(i)
        if on_host:
            self._step_on_host(i, scale)
            return
        self._fetch(i)
        if scale != 1.0:
            for p in self.stage_params[i]:
                if p.grad is not None:
                    p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _measure(self, i: int) -> None:
        """Add stage i's squared gradient norm to the step's (a new step's when i is the
        first stage updated: the last)."""
        if not self.measures_norm:
            return
        if i == self._first_update:  # a new step's updates begin (the last stage first)
            self._square_norm = 0.0
        self._square_norm += square_norm(p.grad for p in self.stage_params[i]
                                         if p.grad is not None)

    def dispatch(self, op: Transfer) -> None:
        """Start the plan's transfer of a stage's states: a Load reads them back (after their
        write in flight), a Store hands them to the writer and drops them from the optimizer
        (the plan places both, ``plan/state_schedule.py``). The Store of a host-stepped
        stage's gradients (``what="grads"``) copies them down to host RAM for its step,
        their norm measured as they leave."""
        if op.what == GRADS:
            if not isinstance(op, Store) or self.host is None:
                raise TierflowError(f"{op}: the optimizer only sends the gradients of the "
                                    "stages it steps in host RAM down")
            self._measure(op.stage)
            self._measured.add(op.stage)
            self.host.send_down(op, self.stage_params[op.stage])
            return
        if isinstance(op, Load):
            if op.after_store and not self._offloaded[op.stage] and \
                    self._writer.last is not None:
                self._writer.last.result()  # nothing to read yet: its states are made anew
            self._prefetch(op.stage, str(op), op.resource, op.after_store)
        elif isinstance(op, Store):
            self._evict(op.stage, str(op), op.resource)

    def _step_on_host(self, i: int, scale: float,
                      stashed: dict[int, torch.Tensor] | None = None) -> None:
        """Hand stage i to the host thread, its states (on disk) read meanwhile."""
        if self.read_ahead:
            self._prefetch(i)
        self.host.update(i, self.stage_params[i], self._twins[i], self.optimizers[i], scale,
                         stashed, fetch=functools.partial(self._fetch, i),
                         release=functools.partial(self._evict, i))

    def stage_state_dict(self, i: int) -> dict | None:
        """Stage i's optimizer ``state_dict()`` with its own copies of the tensors that live on
        disk (read into fresh buffers; the optimizer is left as it was). One stage at a time,
        so a checkpoint of states larger than the RAM budget is written stage by stage."""
        opt = self.optimizers[i]
        if opt is None:
            return None
        if self.host is not None:
            self.host.wait()
        entries = self._offloaded[i]
        state = opt.state_dict()  # evicted tensors are placeholders in it
        if not entries:
            return copy.deepcopy(state)
        pending = self._writer.writes.get(i)
        _, buffers = self._read(i, [(shape, dtype) for _, _, shape, dtype in entries], pending)
        stored = {(id(live), key): buffer for (live, key, _, _), buffer in zip(entries, buffers)}
        params = [p for group in opt.param_groups for p in group["params"]]  # index k: params[k]
        copied = {}
        for index, values in state["state"].items():
            live = id(opt.state[params[index]])
            copied[index] = {key: stored.get((live, key), _copy(value))
                             for key, value in values.items()}
        return {**{k: _copy(v) for k, v in state.items() if k != "state"}, "state": copied}

    def offloaded_shapes(self, i: int) -> dict[tuple[int, str], tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of stage i's states on disk, by (index in its ``state_dict()``,
        state name)."""
        opt = self.optimizers[i]
        if opt is None or not self._offloaded[i]:
            return {}
        index = {id(opt.state[p]): k for k, p in enumerate(
            p for group in opt.param_groups for p in group["params"]) if p in opt.state}
        return {(index[id(live)], key): (shape, dtype)
                for live, key, shape, dtype in self._offloaded[i]}

    def load_stage_state(self, i: int, state: dict) -> None:
        """Replace stage i's optimizer state (a ``state_dict()``), then move it to the disk
        tier if states live there: resuming holds one stage's states at a time."""
        opt = self.optimizers[i]
        if opt is None:
            raise ValueError(f"stage {i} has no optimizer")
        if self.host is not None:
            self.host.wait()
        self._fetch(i)
        opt.load_state_dict(state)
        self._evict(i)

    @property
    def last_norm(self) -> float | None:
        """The global gradient norm of the last step's updates (before any clipping)."""
        return math.sqrt(self._square_norm) if self._square_norm is not None else None

    def state_bytes(self) -> int:
        """Bytes of every stage's optimizer states, in memory and on the disk tier."""
        resident = sum(t.nbytes for opt in self.optimizers if opt is not None
                       for values in opt.state.values() for t in values.values()
                       if isinstance(t, torch.Tensor))
        on_disk = sum(shape.numel() * dtype.itemsize for entries in self._offloaded
                      for _, _, shape, dtype in entries)
        return resident + on_disk

    def _prefetch(self, i: int, name: str | None = None, resource: str = "disk read",
                  after_store: bool = False) -> None:
        """Start reading stage i's offloaded states after their pending write (if any;
        ``after_store``: after the last write of any stage's, whose buffer it may take); a
        no-op before their first write (the optimizer makes them at its first step)."""
        entries = self._offloaded[i]
        if entries and i not in self._reads:
            shapes = [(shape, dtype) for _, _, shape, dtype in entries]
            pending = self._writer.last if after_store else self._writer.writes.get(i)
            self._reads[i] = self._reader.submit(self._read, i, shapes, pending,
                                               name or f"read optimizer states {i}", resource)

    def _read(self, i: int, shapes: list[tuple[torch.Size, torch.dtype]],
              pending: Future | None, name: str = "", resource: str = "disk read",
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(pool buffer, stage i's states viewing it), read from disk."""
        if pending is not None:
            pending.result()
        with span(name or f"read optimizer states {i}", resource):
            flat, buffers = self._pool_of(i).views(shapes)
            self.disk.read(f"optimizer-{i}", buffers, FRESH)
        return flat, buffers

    def _fetch(self, i: int) -> None:
        """Put stage i's offloaded states back in its optimizer, read from disk."""
        entries = self._offloaded[i]
        if not entries:
            return
        self._prefetch(i)
        with span(f"wait for optimizer states {i}", "compute"):  # inside the op's span
            self._flat[i], buffers = self._reads.pop(i).result()
        for (state, key, _, _), buffer in zip(entries, buffers):
            state[key] = buffer
        entries.clear()

    def _evict(self, i: int, name: str | None = None, resource: str = "disk write") -> None:
        """Hand stage i's state tensors to the writer and drop them from the optimizer (a
        no-op without a lower tier, and for a stage stepped in the host RAM its states live
        in); the writer frees them once they are on disk."""
        if self.disk is None or (i in self._twins and self.disk.kind == "ram"):
            return
        entries = self._offloaded[i]
        tensors = []
        for p in self._twins.get(i, self.stage_params[i]):  # what its optimizer steps
            state = self.optimizers[i].state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    entries.append((state, key, value.shape, value.dtype))
                    tensors.append(value.contiguous())
        for state, key, _, _ in entries:
            state[key] = _EVICTED
        self._pool_of(i).expect([(shape, dtype) for _, _, shape, dtype in entries])
        self._writer.submit(i, self._write, i, tensors, self._flat.pop(i, None),
                            name or f"write optimizer states {i}", resource,
                            self.disk.copier.mark())

    def _write(self, i: int, tensors: list[torch.Tensor], flat: torch.Tensor | None,
               name: str, resource: str, after: CopyAfter) -> None:
        """Write stage i's states (once the kernels before ``after`` ran); then the pool
        buffer they were read into (if any) is free: nothing views it any more (the states
        were just evicted, or replaced by a load)."""
        with span(name, resource):
            self.disk.write(f"optimizer-{i}", tensors, after)
        if flat is not None:
            self._pool_of(i).give(flat)

    def _pool_of(self, i: int) -> BufferPool:
        """Where stage i's states are read to: host RAM if the host steps it."""
        return self._host_pool if i in self._twins else self._pool

    def release_buffers(self) -> None:
        """After a step's last update: the pools keep no free buffer until the next step's
        updates begin (the plan counts none through the forward and backward; see
        exec/buffers.py)."""
        self._pool.release()
        self._host_pool.release()

    def reuse_buffers(self) -> None:
        """A step's updates begin: a buffer one stage's write frees may serve the next read."""
        self._pool.reuse()
        self._host_pool.reuse()

    def wait(self) -> None:
        """Until every host step has run and every state write has reached the disk (and
        raise their errors)."""
        self.wait_host_updates()
        self._writer.wait()

    def wait_host_updates(self) -> None:
        """Until every step in host RAM has run: the end of a backward, so that the weights
        are up to date when it returns."""
        if self.host is not None:
            self.host.wait()

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = lr


def stage_owned_parameters(chain: Chain) -> list[list[nn.Parameter]]:
    """Per stage, the trainable parameters its optimizer steps: those whose last gradient
    comes from its backward (a parameter several stages use belongs to the first)."""
    owner: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for i, stage in enumerate(chain.stages):
        for p in stage.parameters():
            if p.requires_grad:
                key = storage_key(p)
                owner[key] = min(owner.get(key, i), i)
                params[key] = p
    owned: list[list[nn.Parameter]] = [[] for _ in chain.stages]
    for key, i in owner.items():
        owned[i].append(params[key])
    return owned


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
