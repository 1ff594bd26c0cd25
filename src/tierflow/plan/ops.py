"""The operations of one training step and the Plan that orders them. Pure data.

Values: x[i] is the input of stage i (x[0] the caller's input, x[L] the chain's output),
tape[i] what stage i's forward kept for its backward, grad[i] the gradient of x[i].

- ``Forward(i, tape, selective)``: compute x[i+1] from x[i]; with ``tape`` keep tape[i] for
  backward, with ``selective`` only its matmul and attention outputs (the backward
  recomputes the rest: exec/selective.py).
- ``Backward(i)``: from tape[i] and grad[i+1] compute grad[i] and stage i's parameter
  gradients; consumes tape[i], grad[i+1] and the plan's references to x[i] and x[i+1].
- ``Free(i)``: drop the plan's reference to x[i] (a checkpoint no longer needed).
- ``Update(i, resource)``: optimizer step of stage i's parameters, then free their
  gradients (only when tierflow owns the optimizer); ``resource`` says what steps it: the
  compute tier (``COMPUTE``), or the host optimizer's thread in host RAM
  (``HOST_OPTIMIZER``: exec/host_update.py), handed the stage's gradients.
- ``Stash(i)``: move the checkpoint x[i] to the tier below while no op needs it (only for
  the boundaries the costs call stashable: its write runs beside the next forwards).
- ``Fetch(i)``: x[i] is back in memory from here (the executor reads it one backward ahead).

Transfers of a stage's tensors between tiers, each started on its own resource (an I/O
thread, a copy stream) where the plan puts it and overlapping the ops after it:

- ``Load(what, i, src, dst, resource, nbytes, after_store)``: start bringing stage i's
  ``what`` (its weights) from tier ``src`` into the compute tier ``dst``; an op of stage i
  waits for it. The read starts once the last Store of stage i's ``what`` is written; with
  ``after_store``, once the last Store of any stage's ``what`` is (read on demand, one
  stage's copy in memory at a time: the buffer that write frees takes the read).
- ``Store(what, i, src, dst, resource, nbytes, keep)``: start writing stage i's updated
  ``what`` from the compute tier back to ``dst``; the copy in memory is dropped once
  written, unless ``keep`` (its next use comes before it could be read back).
- ``Drop(what, i, tier)``: forget the compute tier's copy (the one below is current), once
  a Store of it in flight is done.

A collective between the ranks of data-parallel training, started where the plan puts it:

- ``Reduce(i, resource, nbytes)``: start averaging stage i's parameter gradients over the
  ranks on ``resource`` (the network; ``nbytes`` through each rank's link), in the step's
  last micro-batch (the others accumulate locally, as DDP's ``no_sync``); what reads the
  stage's gradients after it (its Update, a Store of them) waits for it
  (``plan/reductions.py``).
- ``Gather(i, resource, nbytes)``: start all-gathering stage i's updated parameter shards
  (ZeRO-2: each rank stepped only its shard), in the plan's ``gathers`` routine that runs
  after the optimizer's step; the routine ends once every gather has arrived.
- ``Exchange(what, resource, nbytes)``: all-gather a few values of the step over the ranks
  (``what``: its loss, the shards' squared gradient norms that clipping needs, its memory
  report), in the plan's ``exchanges`` routine (``plan/reductions.py``); the step waits for
  it, since what it returns decides what runs next (the clipping factor) or is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union


@dataclass(frozen=True)
class Forward:
    stage: int
    tape: bool
    selective: bool = False  # the tape keeps only the matmul and attention outputs

    def __post_init__(self) -> None:
        if self.selective and not self.tape:
            raise ValueError(f"Forward({self.stage}): selective without a tape")

    def to_dict(self) -> dict:
        return {"op": "forward", "stage": self.stage, "tape": self.tape,
                "selective": self.selective}

    def __str__(self) -> str:
        return f"F{'sel' if self.selective else 'all' if self.tape else ''}({self.stage})"


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


COMPUTE = "compute"  # the resource of the compute tier's ops
HOST_OPTIMIZER = "host optimizer"  # the thread that steps stages in host RAM


@dataclass(frozen=True)
class Update:
    stage: int
    resource: str = COMPUTE  # what steps it: COMPUTE or HOST_OPTIMIZER

    def __post_init__(self) -> None:
        if self.resource not in (COMPUTE, HOST_OPTIMIZER):
            raise ValueError(f"Update({self.stage}): unknown resource {self.resource!r}")

    @property
    def on_host(self) -> bool:
        return self.resource == HOST_OPTIMIZER

    def to_dict(self) -> dict:
        return {"op": "update", "stage": self.stage, "resource": self.resource}

    def __str__(self) -> str:
        return f"U{'h' if self.on_host else ''}({self.stage})"


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


WEIGHTS = "weights"  # what a transfer moves: a stage's own parameters


@dataclass(frozen=True)
class Load:
    what: str
    stage: int
    src: str  # the tier it comes from
    dst: str  # the compute tier
    resource: str  # what carries it: "disk read", "copy up", ...
    nbytes: int
    after_store: bool = False  # waits for the last Store of any stage's ``what``

    def to_dict(self) -> dict:
        out = {"op": "load", "what": self.what, "stage": self.stage, "src": self.src,
               "dst": self.dst, "resource": self.resource, "nbytes": self.nbytes}
        return {**out, "after_store": True} if self.after_store else out

    def __str__(self) -> str:
        after = " after store" if self.after_store else ""
        return f"load({self.what[0]}{self.stage} {self.src}>{self.dst}{after})"


@dataclass(frozen=True)
class Store:
    what: str
    stage: int
    src: str  # the compute tier
    dst: str  # the tier it goes back to
    resource: str  # what carries it: "disk write", "copy down", ...
    nbytes: int
    keep: bool = False  # the copy in memory stays for its next use

    def to_dict(self) -> dict:
        return {"op": "store", "what": self.what, "stage": self.stage, "src": self.src,
                "dst": self.dst, "resource": self.resource, "nbytes": self.nbytes,
                "keep": self.keep}

    def __str__(self) -> str:
        keep = " keep" if self.keep else ""
        return f"store({self.what[0]}{self.stage} {self.src}>{self.dst}{keep})"


@dataclass(frozen=True)
class Drop:
    what: str
    stage: int
    tier: str  # the compute tier, whose copy is forgotten

    def to_dict(self) -> dict:
        return {"op": "drop", "what": self.what, "stage": self.stage, "tier": self.tier}

    def __str__(self) -> str:
        return f"drop({self.what[0]}{self.stage})"


@dataclass(frozen=True)
class _BetweenRanks:
    """A collective over stage i's tensors: Reduce (its gradients) or Gather (its weights)."""

    stage: int
    resource: str  # what carries it: the network between the ranks
    nbytes: int  # through each rank's link
    KIND: ClassVar[str] = ""
    TENSOR: ClassVar[str] = ""  # g: gradients, w: weights

    def to_dict(self) -> dict:
        return {"op": self.KIND, "stage": self.stage, "resource": self.resource,
                "nbytes": self.nbytes}

    def __str__(self) -> str:
        return f"{self.KIND}({self.TENSOR}{self.stage})"


@dataclass(frozen=True)
class Reduce(_BetweenRanks):
    KIND: ClassVar[str] = "reduce"
    TENSOR: ClassVar[str] = "g"


@dataclass(frozen=True)
class Gather(_BetweenRanks):
    KIND: ClassVar[str] = "gather"
    TENSOR: ClassVar[str] = "w"


@dataclass(frozen=True)
class Exchange:
    """An all-gather of a few values of the step over the ranks (see the module's list)."""

    what: str  # which values: plan/reductions.py's LOSS, GRADIENT_NORM or MEMORY_REPORT
    resource: str  # the network between the ranks
    nbytes: int  # through each rank's link

    def to_dict(self) -> dict:
        return {"op": "exchange", "what": self.what, "resource": self.resource,
                "nbytes": self.nbytes}

    def __str__(self) -> str:
        return f"exchange({self.what})"


Collective = Union[Reduce, Gather]
COLLECTIVES = (Reduce, Gather)
Transfer = Union[Load, Store, Drop, Reduce, Gather]
Op = Union[Forward, Backward, Free, Update, Stash, Fetch, Load, Store, Drop, Reduce, Gather,
           Exchange]
TRANSFERS = (Load, Store, Drop, Reduce, Gather)


def stage_of(op: Op) -> int | None:
    """The stage whose parameters a compute op uses (None for any other op)."""
    return op.stage if isinstance(op, (Forward, Backward, Update)) else None


def op_from_dict(data: dict) -> Op:
    """Inverse of ``op.to_dict()``; raises ValueError naming an unknown op."""
    kind = data.get("op")
    if kind == "forward":
        return Forward(int(data["stage"]), bool(data["tape"]), bool(data["selective"]))
    if kind == "backward":
        return Backward(int(data["stage"]))
    if kind == "free":
        return Free(int(data["index"]))
    if kind == "update":
        return Update(int(data["stage"]), str(data["resource"]))
    if kind == "stash":
        return Stash(int(data["index"]))
    if kind == "fetch":
        return Fetch(int(data["index"]))
    if kind == "load":
        return Load(str(data["what"]), int(data["stage"]), str(data["src"]), str(data["dst"]),
                    str(data["resource"]), int(data["nbytes"]),
                    bool(data.get("after_store", False)))
    if kind == "store":
        return Store(str(data["what"]), int(data["stage"]), str(data["src"]), str(data["dst"]),
                     str(data["resource"]), int(data["nbytes"]), bool(data["keep"]))
    if kind == "drop":
        return Drop(str(data["what"]), int(data["stage"]), str(data["tier"]))
    if kind in ("reduce", "gather"):
        collective = Reduce if kind == "reduce" else Gather
        return collective(int(data["stage"]), str(data["resource"]), int(data["nbytes"]))
    if kind == "exchange":
        return Exchange(str(data["what"]), str(data["resource"]), int(data["nbytes"]))
    raise ValueError(f"unknown plan op {kind!r}: expected forward, backward, free, update, "
                     "stash, fetch, load, store, drop, reduce, gather or exchange")


def forward_phase_length(ops: list[Op] | tuple[Op, ...], length: int) -> int:
    """How many ops run before the chain's output x[length] exists (the drop-in forward)."""
    for k, op in enumerate(ops):
        if isinstance(op, Forward) and op.stage == length - 1:
            return k + 1
    raise ValueError(f"plan never computes the chain output x[{length}]")
