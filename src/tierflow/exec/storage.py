"""Tensor storages by identity (what the tapes, stores and meters count bytes by), and the
one small protocol every tier's store follows: host RAM (``exec/host_store.py``, page-locked
below an accelerator) and the disk (``exec/disk.py``). A plan names tiers; ``fit`` keeps
the store of each by its name."""
from __future__ import annotations

from typing import Protocol

import torch

from .copy_stream import CopyAfter


class TensorStore(Protocol):
    """Tensors kept under string keys on one tier (``kind``: "ram" or "disk")."""

    kind: str

    @property
    def bytes(self) -> int:
        """What the tier holds now."""

    def write(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Keep ``tensors`` (contiguous) under ``key`` (``after``: what the copy off an
        accelerator waits for there, ``exec/copy_stream.py``)."""

    def read(self, key: str, tensors: list[torch.Tensor], after: CopyAfter = None) -> None:
        """Fill ``tensors`` (shaped as written) from what ``key`` holds."""

    def write_all(self, items: list[tuple[str, list[torch.Tensor]]],
                  after: CopyAfter = None) -> None:
        """``write`` each (key, tensors), in one transfer where the tier can batch them."""

    def read_all(self, items: list[tuple[str, list[torch.Tensor]]],
                 after: CopyAfter = None) -> None:
        """``read`` each (key, tensors), in one transfer where the tier can batch them."""


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views and detached aliases share it). The storage
    object, not its data pointer: a streamed weight's storage is emptied and refilled (see
    exec/weights.py) and stays the same storage, while all empty storages share pointer 0."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
