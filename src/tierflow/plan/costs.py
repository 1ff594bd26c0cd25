"""Measured or predicted costs of one training step's chain: the planner's only input.

Pure data (no torch). Stage i maps x[i] to x[i+1]; x[0] is the user's input and x[L] the
chain's output (usually the loss). All sizes are bytes, all times seconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class SelectiveCost:
    """Stage i's taped forward run selectively (exec/selective.py): it keeps the outputs of
    its matmuls and attention and its backward first recomputes the rest from them. ``tape``
    replaces the stage's tape, ``recompute_time`` adds to its backward, and the transients
    replace its taped forward's and its backward's (the backward holds what it recomputes)."""

    tape: int
    recompute_time: float
    fwd_transient: int
    bwd_transient: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"SelectiveCost: {f.name}={getattr(self, f.name)} must be >= 0")


@dataclass(frozen=True)
class StageCost:
    """What running stage i costs.

    `tape` is what a forward with autograd keeps for backward, not counting the stage's
    parameters, its input or its output (those are accounted as values of their own).
    Transients are the extra bytes an operation needs only while it runs. `param_bytes` are
    the trainable parameters (each gets a gradient and optimizer states); `frozen_bytes`
    the stage's own parameters that take no gradient (a fine-tune's frozen layers): weights
    only, which streaming moves as it moves the others but never writes back.
    """

    name: str
    fwd_time: float  # forward, seconds
    bwd_time: float  # backward (without the forward), seconds
    param_bytes: int  # trainable parameters this stage owns
    output_bytes: int  # x[i+1]
    tape: int  # bytes saved for backward beyond params, input and output
    output_in_tape: bool = False  # the backward needs the output tensor itself (e.g. ReLU)
    fwd_transient: int = 0  # extra bytes while a forward with tape runs
    fwd_transient_nograd: int = 0  # extra bytes while a forward without tape runs
    bwd_transient: int = 0  # extra bytes while the backward runs
    input_grad: bool = True  # the backward produces a gradient for x[i]
    update_time: float = 0.0  # optimizer step of this stage's parameters, seconds
    update_transient: int = 0  # extra bytes while the optimizer step runs
    # the host optimizer's step of it, seconds, when the plan steps it in host RAM (its
    # Update names that thread: plan/timeline.py prices it there, update_time the hand-over)
    host_update_time: float = 0.0
    # the largest single tensor its forward or backward allocates (measured on the host
    # under a RAM budget, else 0): a block that malloc's scattered free pieces cannot serve
    largest_block: int = 0
    frozen_bytes: int = 0  # parameters this stage alone uses that take no gradient
    # False when nothing in this stage or before it trains (nor needs the input's gradient):
    # its forward keeps no tape and it has no backward (plan/forward_only.py)
    needs_backward: bool = True
    # its taped forward run selectively (None: not measured, or it would keep nothing: a
    # stage without matmuls that autograd records)
    selective: SelectiveCost | None = None

    @property
    def weight_bytes(self) -> int:
        """Every weight the stage alone holds, trainable or frozen: what streaming moves."""
        return self.param_bytes + self.frozen_bytes

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"StageCost {self.name!r}: {f.name}={value} must be >= 0")


@dataclass(frozen=True)
class ChainCosts:
    """Costs of a whole chain plus what stays resident outside the chain's activations.

    `static_bytes` is what lives for the whole step whatever the plan: parameters, optimizer
    states and the runtime's own overhead. Gradient bytes are simulated per stage (they
    appear at the stage's first backward), so they are not part of it, unless
    `grads_resident`: gradients accumulated over micro-batches by an optimizer outside the
    plan live for the whole step, so they are static and a backward adds none.
    """

    stages: tuple[StageCost, ...]
    input_bytes: int  # x[0], held by the caller for the whole step
    context_bytes: int = 0  # the step's side inputs (masks, rotary tables), held throughout
    static_bytes: int = 0
    optimizer_owned: bool = False  # updates run inside the backward, freeing gradients
    shared_grad_bytes: int = 0  # gradients of parameters used by several stages (tied)
    grads_resident: bool = False  # parameter gradients are in static_bytes (accumulation)
    # boundaries x[i] a plan may hold on the tier below while no op needs them (Stash/Fetch);
    # their reads and writes hide behind compute, their bytes in flight are static bytes
    stashable: tuple[int, ...] = ()
    # bytes per second of each resource a plan's transfers use ("disk read", "copy up", ...)
    bandwidths: dict = field(default_factory=dict)
    # the stages whose tape, backward and transients are their selective variant's: every
    # taped forward of theirs runs selectively (plan/selective.py)
    selective: tuple[int, ...] = ()
    # bytes of static_bytes that buffer one stage's optimizer states, and one stage's tape, in
    # flight to or from a lower tier, which some ops run without (plan/buffer_windows.py)
    state_buffer_bytes: int = 0
    tape_buffer_bytes: int = 0
    extra: dict = field(default_factory=dict)  # free-form facts for explain(): dtype, shapes

    @property
    def length(self) -> int:
        return len(self.stages)

    def x_bytes(self, i: int) -> int:
        """Bytes of x[i]: the input for i == 0, else the output of stage i - 1."""
        return self.input_bytes if i == 0 else self.stages[i - 1].output_bytes

    def to_dict(self) -> dict:
        return {"stages": [asdict(s) for s in self.stages], "input_bytes": self.input_bytes,
                "context_bytes": self.context_bytes,
                "static_bytes": self.static_bytes, "optimizer_owned": self.optimizer_owned,
                "shared_grad_bytes": self.shared_grad_bytes,
                "grads_resident": self.grads_resident, "stashable": list(self.stashable),
                "bandwidths": dict(self.bandwidths), "selective": list(self.selective),
                "state_buffer_bytes": self.state_buffer_bytes,
                "tape_buffer_bytes": self.tape_buffer_bytes, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: dict) -> "ChainCosts":
        stages = tuple(StageCost(**{**s, "selective": SelectiveCost(**s["selective"])
                                    if s.get("selective") else None}) for s in data["stages"])
        return cls(stages=stages, input_bytes=data["input_bytes"],
                   context_bytes=data.get("context_bytes", 0),
                   static_bytes=data.get("static_bytes", 0),
                   optimizer_owned=data.get("optimizer_owned", False),
                   shared_grad_bytes=data.get("shared_grad_bytes", 0),
                   grads_resident=data.get("grads_resident", False),
                   stashable=tuple(data.get("stashable", ())),
                   bandwidths=dict(data.get("bandwidths", {})),
                   selective=tuple(data.get("selective", ())),
                   state_buffer_bytes=data.get("state_buffer_bytes", 0),
                   tape_buffer_bytes=data.get("tape_buffer_bytes", 0),
                   extra=dict(data.get("extra", {})))
