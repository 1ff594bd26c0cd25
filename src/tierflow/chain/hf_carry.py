"""Decoder-layer side inputs computed from parameters, carried through the chain.

Some families give their decoder layers inputs that the body computes from parameters before
the loop: Gemma-3n/4's per-layer embeddings, Zamba's embeddings output for its shared
attention blocks, CPM-Ant's learned position bias. Their gradients must reach those
parameters, so they cannot be step constants in the context. Each such tensor (a "slot")
travels in the chain beside the hidden states, from the embed stage to the last layer that
reads it: a boundary is the hidden states and the live slots, flattened and concatenated
into one 1-D tensor (just the hidden states, as they are, when no slot is live), so the
executor keeps, recomputes, offloads and differentiates it like any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import Context

Where = tuple[str, Any]  # ("arg", position after the hidden states) or ("kw", name)


@dataclass(frozen=True)
class Carry:
    uses: tuple[dict[Where, int], ...]  # per layer: which of its side inputs is which slot
    last_use: tuple[int, ...]  # per slot: the last layer that reads it

    @classmethod
    def find(cls, records: list[tuple[tuple, dict]]) -> "Carry | None":
        """Slots from the side inputs that require grad (found by a run with grad), one per
        distinct tensor; None when there are none."""
        slots: dict[int, int] = {}
        uses: list[dict[Where, int]] = []
        last: list[int] = []
        for i, (args, kwargs) in enumerate(records):
            found: dict[Where, int] = {}
            for where, value in _side_inputs(args, kwargs):
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    slot = slots.setdefault(id(value), len(slots))
                    if slot == len(last):
                        last.append(i)
                    last[slot] = i
                    found[where] = slot
            uses.append(found)
        return cls(tuple(uses), tuple(last)) if slots else None

    def collect(self, records: list[tuple[tuple, dict]]) -> dict[int, torch.Tensor]:
        """slot -> its tensor, read from a step's records (caught with grad)."""
        return {uses[where]: value for (args, kwargs), uses in zip(records, self.uses)
                for where, value in _side_inputs(args, kwargs) if where in uses}

    def live(self, i: int) -> list[int]:
        """Slots in the boundary that enters layer i (i = number of layers: the head's)."""
        return [s for s, last in enumerate(self.last_use) if last >= i]

    def strip(self, records: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
        """The records with the carried side inputs left out (None): the chain brings them."""
        out = []
        for (args, kwargs), uses in zip(records, self.uses):
            args = tuple(None if ("arg", k) in uses else a for k, a in enumerate(args))
            kwargs = {k: None if ("kw", k) in uses else v for k, v in kwargs.items()}
            out.append((args, kwargs))
        return out

    def shapes(self, records: list[tuple[tuple, dict]]) -> list[torch.Size]:
        """Each slot's shape, read from a step's records."""
        slots = self.collect(records)
        return [slots[s].shape for s in range(len(self.last_use))]

    def pack(self, hidden: torch.Tensor, slots: dict[int, torch.Tensor], i: int) -> torch.Tensor:
        """The boundary entering layer i: hidden (B, T, h) and the live slots, flat."""
        live = self.live(i)
        if not live:
            return hidden
        return torch.cat([hidden.reshape(-1), *[slots[s].reshape(-1) for s in live]])

    def unpack(self, x: torch.Tensor, ctx: Context, i: int
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(hidden, live slots) of the boundary entering layer i."""
        live = self.live(i)
        if not live:
            return x, {}
        shapes = [ctx["hidden_shape"], *[ctx["carried_shapes"][s] for s in live]]
        parts = torch.split(x, [s.numel() for s in shapes])
        return parts[0].view(shapes[0]), {s: p.view(shape) for s, p, shape in
                                          zip(live, parts[1:], shapes[1:])}

    def fill(self, i: int, args: tuple, kwargs: dict, slots: dict[int, torch.Tensor]
             ) -> tuple[tuple, dict]:
        """Layer i's side inputs with its carried ones put back."""
        uses = self.uses[i]
        args = tuple(slots[uses[("arg", k)]] if ("arg", k) in uses else a
                     for k, a in enumerate(args))
        kwargs = {k: slots[uses[("kw", k)]] if ("kw", k) in uses else v
                  for k, v in kwargs.items()}
        return args, kwargs


def _side_inputs(args: tuple, kwargs: dict):
    yield from ((("arg", k), a) for k, a in enumerate(args))
    yield from ((("kw", k), v) for k, v in kwargs.items())
