"""The operations of one training step and the Plan that orders them. Pure data.

Values: x[i] is the input of stage i (x[0] the caller's input, x[L] the chain's output),
tape[i] what stage i's forward kept for its backward, grad[i] the gradient of x[i].

- ``Forward(i, tape)``: compute x[i+1] from x[i]; with ``tape`` keep tape[i] for backward.
- ``Backward(i)``: from tape[i] and grad[i+1] compute grad[i] and stage i's parameter
  gradients; consumes tape[i], grad[i+1] and the plan's references to x[i] and x[i+1].
- ``Free(i)``: drop the plan's reference to x[i] (a checkpoint no longer needed).
- ``Update(i)``: optimizer step of stage i's parameters, then free their gradients (only
  when tierflow owns the optimizer).
- ``Stash(i)``: move the checkpoint x[i] to the tier below while no op needs it (only for
  the boundaries the costs call stashable: its write runs beside the next forwards).
- ``Fetch(i)``: x[i] is back in memory from here (the executor reads it one backward ahead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Forward:
    stage: int
    tape: bool

    def to_dict(self) -> dict:
        return {"op": "forward", "stage": self.stage, "tape": self.tape}

    def __str__(self) -> str:
        return f"F{'all' if self.tape else ''}({self.stage})"


@dataclass(frozen=True)
class Backward:
    stage: int

    def to_dict(self) -> dict:
        return {"op": "backward", "stage": self.stage}

    def __str__(self) -> str:
        return f"B({self.stage})"


@dataclass(frozen=True)
class Free:
    index: int  # which x[index]

    def to_dict(self) -> dict:
        return {"op": "free", "index": self.index}

    def __str__(self) -> str:
        return f"free(x{self.index})"


@dataclass(frozen=True)
class Update:
    stage: int

    def to_dict(self) -> dict:
        return {"op": "update", "stage": self.stage}

    def __str__(self) -> str:
        return f"U({self.stage})"


@dataclass(frozen=True)
class Stash:
    index: int  # which x[index]

    def to_dict(self) -> dict:
        return {"op": "stash", "index": self.index}

    def __str__(self) -> str:
        return f"stash(x{self.index})"


@dataclass(frozen=True)
class Fetch:
    index: int  # which x[index]

    def to_dict(self) -> dict:
        return {"op": "fetch", "index": self.index}

    def __str__(self) -> str:
        return f"fetch(x{self.index})"


Op = Union[Forward, Backward, Free, Update, Stash, Fetch]


def op_from_dict(data: dict) -> Op:
    """Inverse of ``op.to_dict()``; raises ValueError naming an unknown op."""
    kind = data.get("op")
    if kind == "forward":
        return Forward(int(data["stage"]), bool(data["tape"]))
    if kind == "backward":
        return Backward(int(data["stage"]))
    if kind == "free":
        return Free(int(data["index"]))
    if kind == "update":
        return Update(int(data["stage"]))
    if kind == "stash":
        return Stash(int(data["index"]))
    if kind == "fetch":
        return Fetch(int(data["index"]))
    raise ValueError(f"unknown plan op {kind!r}: expected forward, backward, free, update, "
                     "stash or fetch")


def forward_phase_length(ops: list[Op] | tuple[Op, ...], length: int) -> int:
    """How many ops run before the chain's output x[length] exists (the drop-in forward)."""
    for k, op in enumerate(ops):
        if isinstance(op, Forward) and op.stage == length - 1:
            return k + 1
    raise ValueError(f"plan never computes the chain output x[{length}]")
