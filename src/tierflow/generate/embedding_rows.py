"""An input embedding that holds only the rows it looks up, read from the checkpoint.

A forward pass looks up a few rows of the (vocab, hidden) table: one per new token, the
prompt's ids in the prefill. When the table is not shared with the head, streamed generation
need not keep it in RAM: a forward pre-hook reads the rows of the distinct ids in the input
(``pread``, no read-ahead, pages dropped after), points the module's weight at that small
(distinct ids, hidden) table and hands the module the ids renumbered into it; the post-hook
points the weight back at an empty placeholder. The module's own forward computes the
output, so a family's extras (Gemma's embedding scale) still apply, and the values are the
ones the full table gives.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..core.errors import TierflowError
from ..models.safetensors_io import StoredTensor


class EmbeddingRows:
    """Serve ``module`` (an ``nn.Embedding`` whose table is ``stored``) row by row."""

    def __init__(self, module: nn.Embedding, stored: StoredTensor):
        self.module = module
        self.stored = stored
        self.dtype = module.weight.dtype
        self.row_bytes = stored.nbytes // stored.shape[0]
        self.placeholder = torch.empty(0, dtype=self.dtype)
        module.weight.data = self.placeholder
        self.fd = os.open(stored.file, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # a row, not what follows it
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.rows_read = 0
        self.hooks = [module.register_forward_pre_hook(self._lookup),
                      module.register_forward_hook(self._release)]

    def _lookup(self, module: nn.Module, args: tuple) -> tuple:
        ids, *rest = args  # (batch, seq) token ids
        distinct, renumbered = torch.unique(ids, return_inverse=True)
        table = torch.empty(len(distinct), self.row_bytes, dtype=torch.uint8)
        for row, token in zip(table, distinct.tolist()):
            self._read(row, self.stored.offset + token * self.row_bytes)
        self.rows_read += len(distinct)
        # (distinct, hidden) in the stored dtype, then in the compute dtype
        table = table.view(self.stored.dtype).view(len(distinct), *self.stored.shape[1:])
        module.weight.data = table.to(self.dtype)
        return (renumbered.view_as(ids), *rest)

    def _read(self, row: torch.Tensor, offset: int) -> None:
        buffer = memoryview(row.numpy())
        done = 0
        while done < self.row_bytes:
            got = os.preadv(self.fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise TierflowError(f"{self.stored.file} ends at byte {offset + done}, inside "
                                    "the embedding table its header names: the checkpoint was "
                                    "changed or truncated; copy or save it again")
            done += got
        first = offset // self.page * self.page  # whole pages, or nothing is dropped
        end = -(-(offset + self.row_bytes) // self.page) * self.page
        os.posix_fadvise(self.fd, first, end - first, os.POSIX_FADV_DONTNEED)

    def _release(self, module: nn.Module, args: tuple, output: Any) -> None:
        module.weight.data = self.placeholder

    def close(self) -> None:
        """Remove the hooks and close the file."""
        for hook in self.hooks:
            hook.remove()
        os.close(self.fd)
