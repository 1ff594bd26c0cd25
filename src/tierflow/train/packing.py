"""Packed fine-tuning batches: whole documents of a masked token file laid into rows of
``seq_len`` tokens, each attending only within its own document, the loss on its targets only.

A row holds whole documents one after another (in file order, padded at the end);
``position_ids`` restart at 0 for each document, which is how transformers recognises packed
sequences: its mask functions then confine attention to each document (a block-diagonal
causal mask for SDPA and eager attention, variable-length attention for flash attention), and
the rotary positions are the document's own. ``shift_labels[j]`` is the token after position
``j`` when that token is in the same document and is a target (the loss mask), else -100.

Batch ``k`` is rows ``k * rows .. (k + 1) * rows`` of a seeded permutation of the rows per
epoch, so the stream's position is one integer as for ``data.Batches``. The loss of a step is
its targets' summed cross-entropy over their count in the whole step (every micro-batch):
``step_inputs`` gives each micro-batch that count as ``num_items_in_batch``, so gradient
accumulation of N equals one batch N times larger whatever the masks.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.errors import TierflowError
from ..data.packing import document_lengths, pack_rows
from ..data.tokenfile import TokenFile

IGNORE = -100  # the label that counts nothing (transformers' and PyTorch's ignore_index)


def packed_row(tokens: TokenFile, docs: list[int], seq_len: int, pad: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, shift_labels, position_ids) of one row, each (seq_len,) int64."""
    ids = np.full(seq_len, pad, dtype=np.int64)
    labels = np.full(seq_len, IGNORE, dtype=np.int64)
    positions = np.zeros(seq_len, dtype=np.int64)
    at = 0
    for doc in docs:
        start, end = int(tokens.offsets[doc]), int(tokens.offsets[doc + 1])
        n = end - start
        doc_ids = tokens.window(start, n)  # (n,)
        mask = np.asarray(tokens.mask[start:end]) if tokens.mask is not None else np.ones(n)
        ids[at:at + n] = doc_ids
        labels[at:at + n - 1] = np.where(mask[1:] > 0, doc_ids[1:], IGNORE)
        positions[at:at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(seq_len - at)  # the padding: a document of its own
    return ids, labels, positions


class PackedBatches:
    """The packed rows of a masked token file, drawn as ``data.Batches`` draws windows."""

    def __init__(self, tokens: TokenFile, seq_len: int, batch_size: int, seed: int,
                 index: int = 0, part: tuple[int, int] = (0, 1), pad: int = 0):
        if tokens.offsets is None:
            raise TierflowError(f"{tokens.path} has no document boundaries (format version "
                                f"{tokens.version}); fix: tokenize it again with this tierflow")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.index = index  # batches drawn so far
        self.pad = pad
        self.rows = pack_rows(document_lengths(tokens), seq_len, str(tokens.path))
        rank, ranks = part
        self.mine = slice(rank * batch_size // ranks, (rank + 1) * batch_size // ranks)

    def next(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch: input_ids, shift_labels and
        position_ids, each (batch_size / ranks, seq_len) int64."""
        n = len(self.rows)
        picks = []
        for p in range(self.index * self.batch_size, (self.index + 1) * self.batch_size):
            order = np.random.default_rng([self.seed, p // n]).permutation(n)  # this epoch's
            picks.append(int(order[p % n]))
        self.index += 1
        return rows_batch(self.tokens, [self.rows[r] for r in picks[self.mine]], self.seq_len,
                          self.pad)

    def state(self) -> dict:
        return {"index": self.index, "seed": self.seed}


def rows_batch(tokens: TokenFile, rows: list[list[int]], seq_len: int,
               pad: int) -> dict[str, torch.Tensor]:
    """The model inputs of ``rows``: each tensor (len(rows), seq_len) int64."""
    parts = [packed_row(tokens, docs, seq_len, pad) for docs in rows]
    stacked = [torch.from_numpy(np.stack(column)) for column in zip(*parts)]
    return dict(zip(("input_ids", "shift_labels", "position_ids"), stacked))


def packed_eval_batches(tokens: TokenFile, seq_len: int, batch_size: int, steps: int,
                        pad: int = 0) -> list[dict[str, torch.Tensor]]:
    """Up to ``steps`` batches of the packed rows of ``tokens``, in order."""
    rows = pack_rows(document_lengths(tokens), seq_len, str(tokens.path))
    return [rows_batch(tokens, rows[i:i + batch_size], seq_len, pad)
            for i in range(0, min(len(rows), steps * batch_size), batch_size)]


def step_inputs(batch: torch.Tensor | dict[str, torch.Tensor], device: torch.device,
                counted: int | None) -> dict[str, torch.Tensor | int]:
    """The module's keyword arguments for one micro-batch: a window batch (rows, seq_len + 1)
    as input_ids and shift_labels; a packed batch as it is, with ``counted`` (the targets of
    the whole step) as ``num_items_in_batch``."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device)
        return {"input_ids": batch[:, :-1], "shift_labels": batch[:, 1:]}
    return {**{k: v.to(device) for k, v in batch.items()}, "num_items_in_batch": counted}


def targets(batch: torch.Tensor | dict[str, torch.Tensor]) -> int:
    """The tokens a batch's loss counts."""
    if isinstance(batch, torch.Tensor):
        return int(batch[:, 1:].numel())
    return int((batch["shift_labels"] != IGNORE).sum())


def planning_sample(rows: int, seq_len: int, packed: bool,
                    device: torch.device) -> dict[str, torch.Tensor | int]:
    """The batch a step is planned for: windows (input_ids and shift_labels), or packed rows
    of two documents each (with position_ids, so that the plan sees the packed mask)."""
    if not packed:
        window = torch.zeros(rows, seq_len + 1, dtype=torch.long, device=device)
        return {"input_ids": window[:, :-1], "shift_labels": window[:, 1:]}
    zeros = torch.zeros(rows, seq_len, dtype=torch.long, device=device)  # (rows, seq_len)
    half = seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).to(device)
    return {"input_ids": zeros, "shift_labels": zeros,
            "position_ids": positions.expand(rows, seq_len), "num_items_in_batch": rows * seq_len}
