"""Count the host's tensor bytes op by op, so that a profiled transient cannot be missed.

The host meter samples the RSS from a thread every half millisecond. On a busy 2-core machine
that thread may not run while a short peak lasts, and a profile round then measures a
transient low: a llama-20m layer's backward at seq 512, batch 4 measured 1.1 to 5.9 MiB over
8 rounds, where the ledger counts 6.6 in every round (``benchmarks/profile_transients.py``).
A plan built on such a round predicts less than the step holds.

``TensorLedger`` sees every op through a dispatch mode and keeps the net bytes of tensor
storage allocated since ``restart``: an op's new output storages add their bytes when it
returns, and any storage it has seen (made by an op, or first met as an input, such as a
tensor saved for backward) takes its bytes off when it is freed. Its peak is a floor that
does not depend on timing. It cannot see buffers a kernel allocates and frees inside itself,
nor malloc's own overhead, so the profiler takes the larger of the two measurements.
Compiled code runs eagerly under a dispatch mode, so compiled stages are not counted with it.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorLedger(TorchDispatchMode):
    """Net bytes of ``device_type`` tensor storage allocated since ``restart`` (``net``), the
    most they reached (``peak``), as seen at op boundaries while the mode is active, and the
    largest single storage allocated (``largest``)."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.net = 0
        self.peak = 0
        self.largest = 0
        self._watched: dict[int, weakref.ref] = {}  # storage address -> weakref to it

    def restart(self) -> None:
        """Count from zero again; storages already seen still take their bytes off when freed."""
        self.net = 0
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        for t in _tensors((args, kwargs)):
            self._watch(t, new=False)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._watch(t, new=True)
        self.peak = max(self.peak, self.net)
        return out

    def _watch(self, t: torch.Tensor, *, new: bool) -> None:
        """Start watching ``t``'s storage; ``new``: an op just made it (count it now)."""
        if t.device.type != self.device_type or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or address in self._watched:
            return
        self._watched[address] = weakref.ref(
            storage, lambda ref, address=address, nbytes=nbytes: self._freed(ref, address, nbytes))
        if new:
            self.net += nbytes
            self.largest = max(self.largest, nbytes)

    def _freed(self, ref: weakref.ref, address: int, nbytes: int) -> None:
        self.net -= nbytes
        if self._watched.get(address) is ref:  # not a storage made since at that address
            del self._watched[address]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
