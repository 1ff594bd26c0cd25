"""Tensors of a safetensors checkpoint read with ``pread``, never memory-mapped.

``read_header`` parses a file's JSON header into ``StoredTensor`` records (file, byte offset,
size, dtype, shape); ``pread_exact`` fills a buffer from one in chunks and drops what it read
from the page cache after each chunk, so that reading a checkpoint leaves no RAM behind the
budget's back (the page cache is not in the process's RSS, but it is the machine's memory);
``read_tensor`` returns one as a fresh tensor of the compute dtype.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import TierflowError

CHUNK_BYTES = 4 << 20  # read, then drop from the page cache, this much at a time
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are in a safetensors file (``offset`` from the file's start)."""

    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its JSON header (8-byte little-endian
    length, then the JSON; data offsets count from the end of the header)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        start = 8 + length
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            tensors[name] = StoredTensor(path, start + begin, end - begin, _DTYPES[info["dtype"]],
                                         tuple(info["shape"]))
        return tensors
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise TierflowError(f"{path} is not a readable safetensors file ({e}): the file is "
                            "corrupt or truncated; copy or save it again") from None


def pread_exact(fd: int, stored: StoredTensor, dest: torch.Tensor, drop_from: int) -> None:
    """Read ``stored`` into ``dest`` (a contiguous uint8 CPU tensor of ``stored.nbytes``) in
    chunks; after each, drop ``[drop_from, bytes read so far)`` of the file from the page cache.
    The range is cumulative because the page cache holds large folios (up to 2 MiB here): a
    folio that a chunk boundary cuts is dropped only by a range covering all of it."""
    buffer = memoryview(dest.numpy())  # (nbytes,) uint8, written in place
    done = 0
    while done < stored.nbytes:
        n = min(CHUNK_BYTES, stored.nbytes - done)
        got = os.preadv(fd, [buffer[done:done + n]], stored.offset + done)
        if got <= 0:
            raise TierflowError(f"{stored.file} ends at byte {stored.offset + done}, inside a "
                                "tensor its header names: the checkpoint was changed or "
                                "truncated; copy or save it again")
        done += got
        os.posix_fadvise(fd, drop_from, stored.offset + done - drop_from,
                         os.POSIX_FADV_DONTNEED)


def read_tensor(fd: int, stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor of ``dtype`` holding ``stored`` (converted when stored otherwise)."""
    raw = torch.empty(stored.nbytes, dtype=torch.uint8)
    pread_exact(fd, stored, raw, stored.offset)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # and what was read ahead past it
    tensor = raw.view(stored.dtype).view(stored.shape)
    return tensor if stored.dtype == dtype else tensor.to(dtype)
