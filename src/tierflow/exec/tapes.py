"""Tapes on a lower tier: what a stage's forward saves for its backward, written out as it is
saved and read back for that backward, instead of being recomputed, where the plan's tape ops
(``plan/tape_schedule.py``) say.

``dispatch(op)`` runs one of those ops: a Store arms stage i's next forward, whose
``hooks(store)`` then give the pack/unpack pair of ``saved_tensors_hooks`` (every saved tensor
that is not a parameter or a step-constant context tensor is handed to a writer thread, freed
once written unless something else holds it, and replaced by a handle); a Load starts reading
stage i's handles back; a Drop forgets them after the backward. On the disk tier a stage's
saved tensors under ``PACK_BELOW`` each (norm statistics, adapter activations, rotary pieces)
go down packed: the writer thread copies them into one host buffer of up to ``PACK_BYTES``,
written as one file when it is full or the forward ends (``finish(store)``), read back as one
and viewed as the saved tensors, instead of one file (a few syscalls and a block of padding)
each. ``unpack`` waits for a handle's read (or reads it then). Recomputing a stage costs its
forward again; offloading its tape costs a write and a read that run beside other stages'
compute: on a CPU with a fast disk the second is the cheaper one.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan.ops import Drop, Load, Store, Transfer
from ..plan.tape_offload import MIN_TAPE_BYTES
from .disk import DiskStore
from .file_io import ALIGN, round_up
from .host_store import HostStore
from .io_threads import transfer_thread
from .stage_call import storage_key
from .trace import span

# the planner's threshold: a stage whose tape (its activations) is smaller stays in memory.
# A stage it offloads goes down whole, however small each saved tensor: the plan counts none
# of its tape in memory (plan/tape_offload.py), and a tape of small tensors (bf16 activations
# of a short sequence, each under 1 MiB) kept whole in memory passed it by that tape
MIN_BYTES = MIN_TAPE_BYTES
PACK_BELOW = 1 << 20  # saved tensors smaller than this go down packed with their stage's others
PACK_BYTES = 4 << 20  # the most bytes one pack holds (a multiple of ALIGN)
_SLOT = 64  # each packed tensor starts at a multiple of this many bytes (vector loads)


@dataclass
class _Handle:
    """A saved tensor that lives on the lower tier."""

    key: str
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    order: list[int] | None  # t.permute(order) is contiguous (None: t is not dense)
    written: Future
    read: Future | None = None
    pack: _Pack | None = None  # the pack it went down in (None: its own file)
    offset: int = 0  # its first byte in the pack


@dataclass
class _Pack:
    """Small saved tensors of one stage, copied back to back into ``flat`` (on the writer
    thread) and written under ``key`` as one; ``written`` resolves once it is on the tier."""

    key: str
    flat: torch.Tensor | None  # the host buffer being filled (None once written)
    used: int = 0
    written: Future = field(default_factory=Future)
    copies: list[Future] = field(default_factory=list)
    read: Future | None = None

    @property
    def nbytes(self) -> int:
        return round_up(self.used)


@dataclass
class _StageTape:
    handles: list[_Handle] = field(default_factory=list)
    packs: list[_Pack] = field(default_factory=list)


class TapeOffload:
    """The offloaded tapes of one fitted module, in ``store``."""

    def __init__(self, store: DiskStore | HostStore, keep: set[int],
                 min_bytes: int = 1):
        self.store = store
        self.keep = keep  # storage keys never offloaded: the parameters
        self.context: set[int] = set()  # and this step's context tensors (masks, rotary tables)
        # saved tensors smaller than this stay in memory; the plan offloads a stage's tape
        # whole (see MIN_BYTES): the default keeps only empty ones
        self.min_bytes = min_bytes
        self._armed: dict[int, Store] = {}  # stage -> the Store its next taped forward runs
        self._writer = transfer_thread("tierflow-tape-write")
        self._reader = transfer_thread("tierflow-tape-read")
        self._tapes: dict[int, _StageTape] = {}
        self._unwritten: list[Future] = []  # writes of the stage whose forward ran last
        self._open: dict[int, tuple[Store, _Pack]] = {}  # stage -> the pack being filled
        # files are what packing saves: host RAM keeps each tensor's copy (one memcpy, no
        # syscall), which a pack would only copy twice
        self._packs = store.kind == "disk"

    def dispatch(self, op: Transfer) -> None:
        """Run one of the plan's tape ops: Store(i) arms stage i's next forward, Load(i)
        starts reading its tape back, Drop(i) forgets it."""
        if isinstance(op, Store):
            self._armed[op.stage] = op
        elif isinstance(op, Load):
            self._prefetch(op)
        elif isinstance(op, Drop):
            self._tapes.pop(op.stage, None)
        else:
            raise ValueError(f"{op}: not a tape transfer")

    def take_armed(self, i: int) -> Store | None:
        """The Store that sends down the tape of stage i's forward about to run (None: the
        tape stays in memory)."""
        return self._armed.pop(i, None)

    def hooks(self, store: Store) -> tuple[Any, Any]:
        """(pack, unpack) for stage i's taped forward. The tapes of the stages before it
        must be on the lower tier first: the plan counts one stage's tape in memory while it
        is written, not a queue that grows while the disk writes slower than the forward
        computes (measured: 1.9 GiB over a 4 GiB budget)."""
        for opened, _ in list(self._open.values()):
            self.finish(opened)  # a forward that ended without its finish
        for write in self._unwritten:
            write.result()
        self._unwritten.clear()
        i = store.stage
        tape = self._tapes.setdefault(i, _StageTape())

        def pack(t: torch.Tensor) -> torch.Tensor | _Handle:
            key = storage_key(t)
            if t.nbytes < self.min_bytes or key in self.keep or key in self.context:
                return t
            name = f"tape-{i}-{len(tape.handles)}"
            order = _dense_order(t)
            if self._packs and order is not None and t.nbytes < PACK_BELOW \
                    and t.device.type == "cpu":
                handle = self._pack(store, tape, name, t, order)
            else:
                handle = _Handle(name, t.shape, t.stride(), t.dtype, t.device, order,
                                 self._writer.submit(self._write, store, name, t.detach(),
                                                     order))
                self._unwritten.append(handle.written)
            tape.handles.append(handle)
            return handle

        return pack, self._unpack

    def finish(self, store: Store) -> None:
        """Stage ``store.stage``'s taped forward has ended (or failed): its last pack goes
        down now, not when a later op needs it."""
        opened = self._open.pop(store.stage, None)
        if opened is not None:
            self._send(*opened)

    def _pack(self, store: Store, tape: _StageTape, name: str, t: torch.Tensor,
              order: list[int]) -> _Handle:
        """A handle for ``t``, whose bytes the writer thread copies into the stage's open
        pack (one that is full goes down first)."""
        size = -(-t.nbytes // _SLOT) * _SLOT
        opened = self._open.get(store.stage)
        if opened is not None and opened[1].used + size > PACK_BYTES:
            self._send(*self._open.pop(store.stage))
            opened = None
        if opened is None:
            opened = (store, _Pack(f"tape-{store.stage}-pack-{len(tape.packs)}",
                                   _aligned_bytes(PACK_BYTES)))
            self._open[store.stage] = opened
            tape.packs.append(opened[1])
            self._unwritten.append(opened[1].written)
        pack = opened[1]
        offset, pack.used = pack.used, pack.used + size
        pack.copies.append(self._writer.submit(_copy_into, pack.flat, offset, t.detach(), order))
        return _Handle(name, t.shape, t.stride(), t.dtype, t.device, order, pack.written,
                       pack=pack, offset=offset)

    def _send(self, store: Store, pack: _Pack) -> None:
        """Write ``pack`` after the copies into it (the writer thread runs them in order)."""
        self._writer.submit(self._write_pack, store, pack)

    def _write_pack(self, store: Store, pack: _Pack) -> None:
        try:
            for copy in pack.copies:
                copy.result()
            self._write(store, pack.key, pack.flat[:pack.nbytes], None)
        except BaseException as e:
            pack.written.set_exception(e)
        else:
            pack.written.set_result(None)
        finally:
            pack.flat, pack.copies = None, []

    def _prefetch(self, load: Load) -> None:
        """Start reading the offloaded tensors of ``load``'s stage back (a no-op if it has
        none)."""
        if load.stage in self._open:  # its forward ended without its finish
            self.finish(self._open[load.stage][0])
        tape = self._tapes.get(load.stage, _StageTape())
        for pack in tape.packs:
            if pack.read is None:
                pack.read = self._reader.submit(self._read_pack, pack, load)
        for handle in tape.handles:
            if handle.read is None and handle.pack is None:
                handle.read = self._reader.submit(self._read, handle, load)

    def forget_all(self) -> None:
        """After a step that failed: no tape held, none in flight (each write and read
        finishes first, so that nothing still fills a buffer the next step reuses)."""
        for store, _ in list(self._open.values()):
            self.finish(store)
        for tape in self._tapes.values():
            for handle in tape.handles:
                handle.written.exception()  # waits; the step runs again and writes anew
                if handle.read is not None:
                    handle.read.exception()
        self._tapes.clear()
        self._unwritten.clear()
        self._armed.clear()

    def _write(self, store: Store, key: str, t: torch.Tensor, order: list[int] | None) -> None:
        data = t.permute(order) if order is not None else t.contiguous()  # no copy if dense
        with span(str(store), store.resource):
            self.store.write(key, [data])

    def _read(self, handle: _Handle, load: Load | None) -> torch.Tensor:
        """The saved tensor with its own strides (compiled backward kernels assert them);
        ``load``: the plan's op that reads it (None: read when the backward needs it)."""
        handle.written.result()
        shape = [handle.shape[d] for d in handle.order] if handle.order is not None \
            else handle.shape
        buffer = torch.empty(shape, dtype=handle.dtype, device=handle.device)
        with span(str(load) if load else f"read {handle.key}",
                  load.resource if load else "compute"):
            self.store.read(handle.key, [buffer])
        if handle.order is not None:  # the same dense layout, dimensions in their own order
            return buffer.as_strided(handle.shape, handle.stride)
        strided = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype,
                                      device=handle.device)
        return strided.copy_(buffer)

    def _read_pack(self, pack: _Pack, load: Load | None) -> torch.Tensor:
        """The pack's bytes, read back as one into a fresh buffer that its tensors view."""
        pack.written.result()
        flat = _aligned_bytes(pack.nbytes)
        with span(str(load) if load else f"read {pack.key}",
                  load.resource if load else "compute"):
            self.store.read(pack.key, [flat])
        return flat

    def _unpack(self, saved: torch.Tensor | _Handle) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.pack is not None:
            pack = saved.pack
            for opened, open_pack in list(self._open.values()):
                if open_pack is pack:
                    self.finish(opened)
            if pack.read is None:
                pack.read = self._reader.submit(self._read_pack, pack, None)
            return _packed_view(pack.read.result(), saved)
        if saved.read is None:
            saved.read = self._reader.submit(self._read, saved, None)
        return saved.read.result()


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized byte buffer whose first byte is ``ALIGN``-aligned (direct I/O moves it
    without a bounce buffer)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes]


def _copy_into(flat: torch.Tensor, offset: int, t: torch.Tensor, order: list[int]) -> None:
    """``t``'s bytes (dense in the order ``order``) into ``flat`` from ``offset``."""
    dense = t.permute(order)
    flat[offset:offset + t.nbytes].view(t.dtype).view(dense.shape).copy_(dense)


def _packed_view(flat: torch.Tensor, handle: _Handle) -> torch.Tensor:
    """The saved tensor of ``handle`` as a view of its pack's bytes, with its own strides."""
    nbytes = handle.shape.numel() * handle.dtype.itemsize
    piece = flat[handle.offset:handle.offset + nbytes].view(handle.dtype)
    return piece.as_strided(handle.shape, handle.stride)


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """Dimensions from outermost to innermost if ``t`` covers its memory densely in some
    order of its dimensions (contiguous, transposed, permuted), else None."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return order if t.permute(order).is_contiguous() else None
