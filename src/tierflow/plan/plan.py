"""A Plan: the ordered ops of one training step, what they are predicted to cost, and why.

Pure data. It carries the costs it was made from, so it can be re-simulated, saved as JSON,
loaded on another machine and explained in words.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace

from ..core.units import format_bytes
from .boundary_schedule import with_boundary_transfers
from .buffer_windows import unheld_bytes
from .costs import ChainCosts
from .forward_only import forward_only_length
from .gradient_schedule import (
    GRADS,
    with_gradient_reads,
    with_gradient_transfers,
    with_host_gradient_stores,
)
from .ops import (
    HOST_OPTIMIZER,
    TRANSFERS,
    WEIGHTS,
    Backward,
    Fetch,
    Forward,
    Free,
    Load,
    Op,
    Reduce,
    Stash,
    Store,
    Update,
    forward_phase_length,
    op_from_dict,
)
from .reductions import NETWORK, exchanges, gathers, with_reductions
from .selective import check_selective
from .simulate import Simulation, check_complete, simulate
from .state_schedule import first_read, with_state_transfers
from .tape_schedule import with_tape_transfers
from .timeline import Timeline, timeline
from .transfers import Transfers
from .weight_schedule import WeightSchedule, check_schedule, schedule_weights

FORMAT_VERSION = 6


@dataclass(frozen=True)
class Routines:
    """The op lists a plan runs besides one micro-batch's ``Plan.ops``, each with its
    transfers in place (``plan/weight_schedule.py``): ``between`` after a micro-batch's
    backward (and the optimizer's work in it), reading what the next one starts with;
    ``update_pass`` the deferred updates after the last micro-batch of a step, then
    ``after_pass``; ``cold`` what a step starts with when nothing was read yet (the first
    step, after a failed one); ``evaluation`` every stage forward without gradients;
    ``gathers`` ZeRO-2's all-gathers of the updated shards after the optimizer's step;
    ``exchanges`` the values the ranks exchange each step, in the order the trainer asks for
    them (``plan/reductions.py``)."""

    between: tuple[Op, ...] = ()
    update_pass: tuple[Op, ...] = ()
    after_pass: tuple[Op, ...] = ()
    cold: tuple[Op, ...] = ()
    evaluation: tuple[Op, ...] = ()
    gathers: tuple[Op, ...] = ()
    exchanges: tuple[Op, ...] = ()

    def to_dict(self) -> dict:
        return {name: [op.to_dict() for op in getattr(self, name)]
                for name in ("between", "update_pass", "after_pass", "cold", "evaluation",
                             "gathers", "exchanges")}

    @classmethod
    def from_dict(cls, data: dict) -> "Routines":
        return cls(**{name: tuple(op_from_dict(o) for o in ops) for name, ops in data.items()})


@dataclass(frozen=True)
class Plan:
    strategy: str  # "keep-all", "checkpoint-all", "rotor"
    ops: tuple[Op, ...]
    costs: ChainCosts
    budget: int | None = None  # the tier budget the plan was made for, bytes, all included
    notes: tuple[str, ...] = field(default_factory=tuple)  # the planner's reasons, in words
    routines: Routines = field(default_factory=Routines)  # the op lists besides ``ops``
    transfers: Transfers | None = None  # what its transfer ops move (None: nothing)

    def __post_init__(self) -> None:
        check_complete(self.costs, self.ops)
        check_selective(self.costs, self.ops)
        weights = self.transfers.weights if self.transfers else None
        if weights is not None:
            r = self.routines
            boundary = frozenset(op.stage for op in r.cold
                                 if isinstance(op, Load) and op.what == WEIGHTS)
            check_schedule(WeightSchedule(self.ops, r.between, r.update_pass, r.after_pass,
                                          r.cold, r.evaluation, boundary), weights)

    @functools.cached_property
    def simulation(self) -> Simulation:
        """``ops`` replayed on the costs, each op without the static buffers of transfers
        that the timeline has free while it runs (``plan/buffer_windows.py``)."""
        unheld = None
        if self.costs.state_buffer_bytes or self.costs.tape_buffer_bytes:
            unheld = unheld_bytes(self.costs, self.ops, self.routines.between, self.timeline)
        return simulate(self.costs, self.ops, unheld)

    @functools.cached_property
    def timeline(self) -> Timeline:
        """When each op runs in the steady state: a micro-batch's ops, then (once the host
        optimizer's steps are done) the reads the next one starts with, as a task graph on
        the resources that carry them."""
        return timeline(self.costs, (*self.ops, *self.routines.between), join=len(self.ops))

    @property
    def predicted_peak(self) -> int:
        """Predicted peak bytes of the compute tier: static bytes plus the step's peak."""
        return self.simulation.total_peak(self.costs)

    @property
    def planned_peak(self) -> int:
        """The compute tier's peak with every static buffer held by every op: what a planner
        fits under a budget, before the transfers are placed (``predicted_peak`` counts the
        buffers some ops run without as free)."""
        return simulate(self.costs, self.ops).total_peak(self.costs)

    @property
    def predicted_time(self) -> float:
        """Seconds of one micro-batch in the steady state (``timeline``)."""
        return self.timeline.time

    @property
    def network_time_between_steps(self) -> float:
        """Seconds of the all-gathers after the optimizer's step (ZeRO-2; else 0) and of the
        step's exchanges of values: one after another on the network."""
        ops = (*self.routines.gathers, *self.routines.exchanges)
        return timeline(self.costs, ops).busy(NETWORK) if ops else 0.0

    def step_time(self, micro_batches: int) -> float:
        """Seconds of the ``micro_batches`` of one optimizer step, its update pass left out:
        the first reads back no accumulated gradients (none were written yet: its gradient
        Loads do nothing), only the last reduces them over the ranks (its Reduce ops), the
        others run ``ops`` as they stand."""
        def seconds(first: bool, last: bool) -> float:
            ops = tuple(op for op in self.ops if not (first and _reads_gradients(op))
                        and not (not last and isinstance(op, Reduce)))
            if len(ops) == len(self.ops):
                return self.predicted_time
            return timeline(self.costs, (*ops, *self.routines.between), join=len(ops)).time
        if micro_batches == 1:
            return seconds(first=True, last=True)
        return (seconds(first=True, last=False) + (micro_batches - 2) * seconds(False, False)
                + seconds(first=False, last=True))

    def with_transfers(self, transfers: Transfers) -> "Plan":
        """This plan's compute ops with the transfers of ``transfers`` placed among them and
        in its routines, and its Updates of ``transfers.host_stages`` run by the host
        optimizer: the loads, stores and drops of streamed weights
        (``plan/weight_schedule.py``), the loads and stores of optimizer states beside the
        updates (``plan/state_schedule.py``), the update pass of deferred updates, the
        stores and loads of the streamed stages' gradients between micro-batches and of the
        host-stepped stages' gradients to host RAM (``plan/gradient_schedule.py``), the stores, loads and drops of the tapes kept below
        (``plan/tape_schedule.py``) and the stores and loads of the stashed checkpoints
        (``plan/boundary_schedule.py``)."""
        compute = tuple(op for op in self.ops if not isinstance(op, TRANSFERS))
        order = transfers.update_order
        step, routines = compute, Routines(update_pass=tuple(Update(i) for i in order or ()))
        if transfers.weights is not None:
            schedule = schedule_weights(compute, transfers.weights, self.costs.length,
                                        order or ())
            step, routines = schedule.step, Routines(
                schedule.between, schedule.update_pass, schedule.after_pass, schedule.cold,
                schedule.evaluation)
        if transfers.host_stages:  # stepped by the host optimizer, in host RAM
            if not transfers.deferred:
                step = _on_host(step, transfers.host_stages)
            routines = replace(routines, update_pass=_on_host(routines.update_pass,
                                                              transfers.host_stages))
        states = transfers.states
        if states is not None:
            updating = routines.update_pass if transfers.deferred else step
            placed = with_state_transfers(updating, states)
            cold = routines.cold + first_read(placed, states)
            if transfers.deferred:
                routines = replace(routines, update_pass=placed, cold=cold)
            else:
                step, routines = placed, replace(routines, cold=cold)
        if transfers.gradients is not None:
            step = with_gradient_transfers(step, transfers.gradients, transfers.accumulates)
        if transfers.host_gradients is not None and not transfers.deferred:
            step = with_host_gradient_stores(step, transfers.host_gradients)
        if transfers.gradients is not None or transfers.host_gradients is not None:
            routines = replace(routines, update_pass=with_gradient_reads(
                routines.update_pass, transfers.gradients, transfers.host_gradients))
        if transfers.tapes is not None:
            step = with_tape_transfers(step, transfers.tapes)
        if transfers.boundaries is not None:
            step = with_boundary_transfers(step, transfers.boundaries)
        costs = self.costs
        if transfers.reductions is not None:  # last: each right after its stage's backward
            routines = replace(routines, gathers=gathers(step, costs, transfers.reductions),
                               exchanges=exchanges(transfers.reductions))
            step = with_reductions(step, costs, transfers.reductions)
            costs = replace(costs, bandwidths={**costs.bandwidths,
                                               NETWORK: transfers.reductions.bus})
        return replace(self, ops=step, costs=costs, routines=routines, transfers=transfers)

    @property
    def host_updated_stages(self) -> frozenset[int]:
        """The stages whose Update the host optimizer runs, in host RAM."""
        return frozenset(op.stage for op in (*self.ops, *self.routines.update_pass)
                         if isinstance(op, Update) and op.on_host)

    @property
    def forward_ops(self) -> tuple[Op, ...]:
        """The ops that run when the module is called; the rest run in ``backward()``."""
        return self.ops[: forward_phase_length(self.ops, self.costs.length)]

    @property
    def backward_ops(self) -> tuple[Op, ...]:
        return self.ops[forward_phase_length(self.ops, self.costs.length):]

    @property
    def evaluation_ops(self) -> tuple[Op, ...]:
        """Every stage forward once without gradients, with the plan's weight transfers."""
        return self.routines.evaluation or tuple(Forward(i, tape=False)
                                                 for i in range(self.costs.length))

    def recomputed_stages(self) -> list[int]:
        """Stages whose forward runs more than once."""
        counts = [0] * self.costs.length
        for op in self.ops:
            if isinstance(op, Forward):
                counts[op.stage] += 1
        return [i for i, n in enumerate(counts) if n > 1]

    def stashed_boundaries(self) -> list[int]:
        """Checkpoints x[i] that wait on the tier below between their uses."""
        return sorted({op.index for op in self.ops if isinstance(op, Stash)})

    def decisions(self) -> dict:
        """What this plan chose, in a form two plans compare by (``tierflow plan --json``'s
        and the trainer's log's): the strategy, what is recomputed and stashed, and what
        its transfers move (weights, states, tapes, gradients), where, and how far ahead, the
        stages its Updates step in host RAM, and how many Loads and Stores of each kind of
        tensor a micro-batch, the reads after it, the update pass and the reads after that
        hold (``transfer_ops``)."""
        moves = self.transfers or Transfers()
        weights, states, tapes = moves.weights, moves.states, moves.tapes
        r = self.routines
        ops: dict[str, dict[str, int]] = {}  # per what, its Loads and Stores in a step
        for op in (*self.ops, *r.between, *r.update_pass, *r.after_pass):
            if isinstance(op, (Load, Store)):
                counts = ops.setdefault(op.what, {"load": 0, "store": 0})
                counts["load" if isinstance(op, Load) else "store"] += 1
        return {"strategy": self.strategy, "recomputed": self.recomputed_stages(),
                "selective": list(self.costs.selective),
                "stashed": self.stashed_boundaries(),
                "streamed": sorted(weights.stages) if weights else [],
                "weights_home": weights.home if weights else None,
                "read_ahead": weights.depth if weights else None,
                "host_updated": sorted(weights.host_updated) if weights else [],
                "states": sorted(dict(states.sizes)) if states else [],
                "states_home": states.home if states else None,
                "tapes": sorted(tapes.stages) if tapes else [],
                "tapes_home": tapes.home if tapes else None,
                "deferred_updates": moves.deferred,
                "gradients": sorted(moves.gradients.stages) if moves.gradients else [],
                "gradients_home": moves.gradients.home if moves.gradients else None,
                "host_steps": sorted(self.host_updated_stages),
                "transfer_ops": dict(sorted(ops.items()))}

    def to_json(self) -> str:
        return json.dumps({"format": "tierflow-plan", "version": FORMAT_VERSION,
                           "strategy": self.strategy, "budget": self.budget,
                           "notes": list(self.notes), "costs": self.costs.to_dict(),
                           "ops": [op.to_dict() for op in self.ops],
                           "routines": self.routines.to_dict(),
                           "transfers": self.transfers.to_dict() if self.transfers else None},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        if data.get("format") != "tierflow-plan" or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a tierflow plan of version {FORMAT_VERSION}: "
                             f"format={data.get('format')!r} version={data.get('version')!r}")
        return cls(strategy=data["strategy"], ops=tuple(op_from_dict(o) for o in data["ops"]),
                   costs=ChainCosts.from_dict(data["costs"]), budget=data["budget"],
                   notes=tuple(data["notes"]), routines=Routines.from_dict(data["routines"]),
                   transfers=Transfers.from_dict(data["transfers"])
                   if data["transfers"] else None)

    def explain(self) -> str:
        """What is kept, what is recomputed, what it costs and why, in words."""
        c = self.costs
        sim = self.simulation
        names = [s.name for s in c.stages]
        taped_first = _first_forward_tape(self.ops, c.length)
        kept = [names[i] for i in range(c.length) if taped_first[i]]
        recomputed = [names[i] for i in self.recomputed_stages()]
        base = sum(s.fwd_time + s.bwd_time for s in c.stages)
        lines = [f"Plan ({self.strategy}) for a chain of {c.length} stages"
                 + (f" under a budget of {format_bytes(self.budget)}" if self.budget else "") + ":",
                 f"  predicted peak {format_bytes(self.predicted_peak)} "
                 f"= {format_bytes(c.static_bytes)} static ({_static_parts(c)})"
                 f" + {format_bytes(sim.peak)} activations, gradients and transients",
                 f"  predicted time of one forward and backward {self.predicted_time * 1e3:.0f} "
                 f"ms ({_overhead(sim.time, base)} over computing every stage once"
                 + (f", then {(self.predicted_time - sim.time) * 1e3:.0f} ms waiting for "
                    "transfers" if self.predicted_time > sim.time * 1.0005 else "") + ")"]
        for lower in ("ram", "disk"):
            held = []
            if c.extra.get(f"optimizer states on {lower}"):
                held.append(f"{format_bytes(c.extra[f'optimizer states on {lower}'])} of "
                            "optimizer states")
            if c.extra.get("weights tier") == lower:
                held.append(f"{format_bytes(c.extra['streamed bytes'])} of streamed weights")
            if c.extra.get("tapes tier") == lower:
                held.append(f"{format_bytes(c.extra['offloaded tape bytes'])} of tapes")
            stashed = self.stashed_boundaries()
            if c.extra.get("boundaries tier") == lower and stashed:
                held.append(f"{format_bytes(sum(c.x_bytes(i) for i in stashed))} of "
                            f"checkpoints ({_names([f'x{i}' for i in stashed])}) between "
                            "their uses")
            if held:
                lines.append(f"  {lower} tier: {' and '.join(held)}")
        prefix = forward_only_length(c)
        if prefix:
            lines.append(f"  forward only, once (nothing in or before them trains): "
                         f"{_names(names[:prefix])}")
        lines.append(f"  kept for backward on the first forward: {_names(kept)}")
        if c.selective:
            lines.append(f"  selective (their tapes keep the matmul and attention outputs; "
                         f"the backward recomputes the rest): "
                         f"{_names([names[i] for i in c.selective])}")
        if recomputed:
            lines.append(f"  recomputed during backward: {_names(recomputed)}; "
                         f"their inputs are kept as checkpoints: "
                         f"{_names([f'x{i}' for i in self.recomputed_stages()])}")
        else:
            lines.append("  nothing is recomputed")
        transfers = [op for op in (*self.ops, *self.routines.between,
                                   *self.routines.update_pass) if isinstance(op, TRANSFERS)]
        reduced = [op for op in self.ops if isinstance(op, Reduce)]
        transfers = [op for op in transfers if not isinstance(op, Reduce)]
        if transfers:
            moved = {}
            for op in transfers:
                moved[op.what] = moved.get(op.what, 0) + getattr(op, "nbytes", 0)
            what = " and ".join(f"{format_bytes(n)} of {kind}" for kind, n in moved.items())
            lines.append(f"  each step moves {what} in {len(transfers)} transfer ops (loads, "
                         "stores, drops) placed among its compute ops")
        if reduced:
            ranks = self.transfers.reductions.ranks
            lines.append(f"  its last micro-batch reduces each stage's gradients over {ranks} "
                         f"ranks right after the stage's backward ({len(reduced)} reduce ops, "
                         f"{format_bytes(sum(op.nbytes for op in reduced))} through each "
                         f"rank's link, on the {NETWORK})")
            if self.routines.gathers:
                gathered = sum(op.nbytes for op in self.routines.gathers)
                lines.append(f"  after the optimizer's step, {len(self.routines.gathers)} gather "
                             f"ops all-gather the updated shards ({format_bytes(gathered)} "
                             "through each rank's link)")
            lines.append("  each step the ranks exchange their "
                         + ", ".join(op.what for op in self.routines.exchanges)
                         + f" ({len(self.routines.exchanges)} exchange ops, a few bytes each)")
        if any(isinstance(op, Update) for op in self.ops):
            lines.append("  each stage's parameters are updated as soon as its gradients are "
                         "complete, then its gradients are freed")
        lines.extend(f"  why: {note}" for note in self.notes)
        return "\n".join(lines)

    def describe_ops(self) -> str:
        """The op sequence in short form, e.g. ``Fall(0) F(1) ... B(0)``."""
        return " ".join(str(op) for op in self.ops)


def _on_host(ops: tuple[Op, ...], stages: frozenset[int]) -> tuple[Op, ...]:
    """``ops`` with the Updates of ``stages`` run by the host optimizer."""
    return tuple(replace(op, resource=HOST_OPTIMIZER)
                 if isinstance(op, Update) and op.stage in stages else op for op in ops)


def _first_forward_tape(ops: tuple[Op, ...], length: int) -> list[bool]:
    first: list[bool | None] = [None] * length
    for op in ops:
        if isinstance(op, Forward) and first[op.stage] is None:
            first[op.stage] = op.tape
    return [bool(t) for t in first]


def _static_parts(costs: ChainCosts) -> str:
    """The static bytes by kind, where the costs say (``extra``), else their kinds."""
    kinds = ("parameters", "gradients", "optimizer states", "reserved", "runtime",
             "allocator", "held before fit")
    parts = [f"{kind} {format_bytes(costs.extra[kind])}" for kind in kinds if costs.extra.get(kind)]
    return ", ".join(parts) if parts else "parameters, optimizer states, runtime"


def _names(items: list[str]) -> str:
    if not items:
        return "none"
    if len(items) > 8:
        return ", ".join(items[:4]) + f", ... ({len(items)} in all), " + items[-1]
    return ", ".join(items)


def _overhead(time: float, base: float) -> str:
    return f"+{(time / base - 1) * 100:.0f}%" if base > 0 else "n/a"


def _reads_gradients(op: Op) -> bool:
    """Whether ``op`` reads back a stage's accumulated gradients for its backward."""
    return isinstance(op, Load) and op.what == GRADS


__all__ = ["Plan", "Routines", "Forward", "Backward", "Free", "Update", "Stash", "Fetch",
           "FORMAT_VERSION"]
