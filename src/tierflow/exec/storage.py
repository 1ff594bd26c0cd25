"""Tensor storages by identity: what the tapes, stores and meters count bytes by."""
from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views and detached aliases share it). The storage
    object, not its data pointer: a streamed weight's storage is emptied and refilled (see
    exec/weights.py) and stays the same storage, while all empty storages share pointer 0."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
