"""Parameters whose data lives on the disk tier: one raw file per parameter, the parameter's
storage emptied (``untyped_storage().resize_(0)``) while it is not needed.

The ``nn.Parameter`` objects stay where they are, with their shapes, so a model can be built
(``tierflow.load_model(..., disk=DIR)``), chained and planned without ever holding all its
weights: uses are counted, a parameter is read in at its first use and emptied after its last.
``on_demand(model)`` fetches a module's own parameters around each of its forward calls
(runs without autograd only: a tape would keep references to the weights); ``resident``
holds a group of parameters for a block of work (profiling a stage with its backward).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .copy_stream import FRESH, CopyAfter
from .disk import DiskStore
from .stage_call import storage_key


class OffloadedParameters:
    """The parameters of one model that live in ``store`` between uses."""

    def __init__(self, store: DiskStore, dtype: torch.dtype | None = None):
        self.store = store
        # the dtype floating parameters are kept in (None: their own): a model trained with
        # bf16 weights is cast as each parameter goes to disk, never whole in fp32 memory
        self.dtype = dtype
        self._files: dict[int, str] = {}  # storage key -> file key
        self._sizes: dict[int, int] = {}  # storage key -> bytes when resident
        self._uses: dict[int, int] = {}  # storage key -> current users
        self._lock = threading.Lock()
        self.resident_bytes = 0  # offloaded parameters' bytes in memory now
        self.peak_resident_bytes = 0

    def __contains__(self, p: torch.Tensor) -> bool:
        return storage_key(p) in self._files

    @property
    def bytes(self) -> int:
        """Bytes of all offloaded parameters (what their files hold)."""
        return sum(self._sizes.values())

    def offload(self, name: str, p: nn.Parameter, device: torch.device | None = None) -> None:
        """Write ``p`` to its own file and empty its storage (until it is next used). With
        ``device``, ``p`` moves there, empty, and its values come up from the file when used
        (a model that starts in host RAM and computes on an accelerator)."""
        if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
            p.data = p.data.to(self.dtype)  # the same Parameter, as apply_precision's cast
        if not p.untyped_storage().resizable():  # e.g. memory from numpy or a mapped file
            p.data = p.data.clone()
        values = p.detach()
        if device is not None and torch.device(device) != p.device:
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            empty.untyped_storage().resize_(0)
            p.data = empty  # the same Parameter; the host tensor goes once written
        key = storage_key(p)
        self._files[key] = f"param-{name}"
        self._sizes[key] = values.untyped_storage().nbytes()
        self._uses[key] = 0
        self.store.write(self._files[key], [values])
        p.untyped_storage().resize_(0)  # built outside: never counted as resident

    def move_model(self, model: nn.Module, device: torch.device) -> None:
        """Put ``model`` on ``device``, the accelerator it computes on: a parameter that lives
        here becomes an empty tensor there, filled from its file when used (a model built
        on disk that trains on a GPU); every other parameter and buffer moves whole."""
        with torch.no_grad():
            for p in model.parameters():
                if p not in self:
                    p.data = p.data.to(device)
                    continue
                old = storage_key(p)
                if p.untyped_storage().nbytes():  # resident now: its values move
                    p.data = p.data.to(device)
                else:
                    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                    empty.untyped_storage().resize_(0)
                    p.data = empty  # the same Parameter, as ``offload`` with a device
                new = storage_key(p)
                for table in (self._files, self._sizes, self._uses):
                    table[new] = table.pop(old)
            for module in model.modules():
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[key] = buffer.to(device)

    def file_of(self, p: torch.Tensor) -> str:
        """The disk store key of ``p``'s file."""
        return self._files[storage_key(p)]

    # ------------------------------------------------------------------ raw transfers

    def read(self, p: torch.Tensor) -> None:
        """Refill ``p``'s storage from its file."""
        self.read_all([p])

    def read_all(self, params: Iterable[torch.Tensor]) -> None:
        """Refill each of ``params``' storages from its file, in one transfer where the store
        batches them; an emptied storage is refilled from the copier's side stream (the copy
        up then waits for no kernel of the compute stream)."""
        refilled, filled = [], []
        for p in params:
            key = storage_key(p)
            if p.untyped_storage().nbytes() == 0:
                self.store.copier.refill(p.detach(), self._sizes[key])
                self._count(self._sizes[key])
                refilled.append((self._files[key], [p.detach()]))
            else:
                filled.append((self._files[key], [p.detach()]))
        if refilled:
            self.store.read_all(refilled, FRESH)
        if filled:
            self.store.read_all(filled)

    def current_copy(self, p: torch.Tensor) -> torch.Tensor:
        """A fresh CPU tensor with ``p``'s current values: a copy of its storage when
        resident (it may be newer than its file), else read from its file. Never a view of
        ``p``: exporting a resizable storage (to numpy, say) would pin its size for good."""
        if p.untyped_storage().nbytes():
            return p.detach().to("cpu", copy=True)
        copy = torch.empty(p.shape, dtype=p.dtype)
        self.store.read(self._files[storage_key(p)], [copy])
        return copy

    def write(self, p: torch.Tensor, after: CopyAfter = None) -> None:
        """Store ``p``'s current values in its file (after an update)."""
        self.write_all([p], after)

    def write_all(self, params: Iterable[torch.Tensor], after: CopyAfter = None) -> None:
        """Store each of ``params``' current values in its file, in one transfer where the
        store batches them (``after``: the mark of the store's dispatch,
        ``exec/copy_stream.py``)."""
        self.store.write_all([(self._files[storage_key(p)], [p.detach()]) for p in params],
                             after)

    def empty(self, p: torch.Tensor) -> None:
        nbytes = p.untyped_storage().nbytes()
        if nbytes:
            p.untyped_storage().resize_(0)
            self._count(-nbytes)

    def _count(self, delta: int) -> None:
        with self._lock:
            self.resident_bytes += delta
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def keep_resident(self, params: Iterable[torch.Tensor]) -> None:
        """Bring ``params`` in for good (the stages that do not stream). A copy in host RAM
        is dropped then (it would hold that RAM for nothing); a file stays on disk."""
        params = list(params)
        self.acquire(params)
        if self.store.kind == "ram":
            for p in params:
                self.store.discard(self.file_of(p))

    # ------------------------------------------------------------------ counted uses

    def acquire(self, params: Iterable[torch.Tensor]) -> None:
        """One more user of each parameter; the first one reads it in."""
        for p in params:
            key = storage_key(p)
            with self._lock:
                self._uses[key] += 1
                first = self._uses[key] == 1
            if first:
                self.read(p)

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """One user less; the last one empties the parameter (its file is up to date)."""
        for p in params:
            key = storage_key(p)
            with self._lock:
                self._uses[key] -= 1
                last = self._uses[key] == 0
            if last:
                self.empty(p)

    @contextlib.contextmanager
    def resident(self, params: Iterable[torch.Tensor]) -> Iterator[None]:
        mine = [p for p in params if p in self]
        self.acquire(mine)
        try:
            yield
        finally:
            self.release(mine)

    @contextlib.contextmanager
    def on_demand(self, model: nn.Module) -> Iterator[None]:
        """Fetch offloaded parameters around every module call: a module of ``model`` its
        own ones, any other module (a chain stage wrapping the model's modules, whose kernels
        may read weights without calling their modules) all of its own and its children's."""
        own = {id(m) for m in model.modules()}
        held: list[list[torch.Tensor]] = []

        def used(module: nn.Module) -> list[torch.Tensor]:
            params = module.parameters(recurse=id(module) not in own)
            return [p for p in params if p in self]

        def before(module: nn.Module, args: tuple) -> None:
            mine = used(module)
            self.acquire(mine)
            if torch.is_grad_enabled():  # the tape may need them after the call: keep
                held.append(mine)

        def after(module: nn.Module, args: tuple, output: object) -> None:
            if not torch.is_grad_enabled():
                self.release(used(module))

        handles = [register_module_forward_pre_hook(before),
                   register_module_forward_hook(after, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for mine in held:
                self.release(mine)


_OFFLOADED: weakref.WeakKeyDictionary[nn.Module, OffloadedParameters] = \
    weakref.WeakKeyDictionary()


def attach(model: nn.Module, offloaded: OffloadedParameters) -> None:
    """Record that ``model``'s parameters live (partly) in ``offloaded``."""
    _OFFLOADED[model] = offloaded


def offloaded_parameters(model: nn.Module) -> OffloadedParameters | None:
    """The disk-resident parameters of ``model`` (None when all of them are in memory)."""
    return _OFFLOADED.get(model)
