"""Measure each distinct stage of a chain once: times, bytes kept for backward, transients.

The sample flows through the chain one stage at a time (only the current boundary is held),
and a stage whose signature, input shape, dtype, device and autocast mode were already
measured, in this run or earlier in this process, is not measured again. Its times are the
ones kept on this machine when there are (``_kept_times``): a time moves by a quarter from
one process to the next, and plans made in two processes (`tierflow plan --measure`, then
`tierflow train`) should be the same plan.
"""
from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..chain.base import Chain
from ..core.config import FitConfig
from ..exec.compile import is_compiled
from ..exec.context import AutocastMode
from ..exec.memory import DeviceMeter, HostMeter, return_free_memory
from ..exec.selective import SelectiveUnsupported
from ..exec.stage_call import context_tensors, forward_plain, forward_taped, storage_key, tape_bytes
from ..exec.weights import stage_parameters_to_stream
from ..plan.costs import SelectiveCost, StageCost
from .machine import Quiet, device_model, keep, recalled
from .tensor_ledger import TensorLedger


@dataclass(frozen=True)
class _Measured:
    """A stage's times and bytes: of one round (a forward without a tape, one with, and the
    backward), or over several (median times, largest transients)."""
    fwd_time: float
    bwd_time: float
    output_bytes: int
    tape: int
    output_in_tape: bool
    fwd_transient: int
    fwd_transient_nograd: int
    bwd_transient: int
    largest_block: int  # the largest tensor the round allocated (0: no ledger counted it)
    recompute_time: float = 0.0  # a selective round's: its backward's recomputation
    selective: SelectiveCost | None = None  # its taped forward run selectively
    timed: bool = True  # False: its times are its memory rounds' (kept ones replace them)


@dataclass(frozen=True)
class Measuring:
    """How ``profile_chain`` measures every stage, the same for each of its rounds: ``meter``
    reads the tier's bytes; ``repeats`` rounds follow a warm-up round; more rounds are
    timed, up to MAX_TIMED_ROUNDS, until the timed ones' forwards and backwards took
    ``seconds`` (one round's time moves by a quarter on a shared 2-core machine: a median
    of two rounds put llama-134m's layer 19-22% under the steps' times in one process and
    17-28% over in another); ``timing``, when given, is a context to time the rounds in (the
    allocator the steps will use, when memory is measured under another); ``selective``:
    also measure each stage's taped forward run selectively (exec/selective.py)."""

    meter: HostMeter | DeviceMeter
    repeats: int = 2
    seconds: float = 0.0
    timing: Callable[[], Any] | None = None
    selective: bool = True

    @classmethod
    def of(cls, config: FitConfig, meter: HostMeter | DeviceMeter,
           timing: Callable[[], Any] | None) -> "Measuring":
        """As ``config`` asks (its repeats, seconds and selective choice), on ``meter``."""
        return cls(meter, repeats=config.profile_repeats, seconds=config.profile_seconds,
                   timing=timing, selective=config.selective != "never")


@dataclass(frozen=True)
class StageRun:
    """A stage and what each of its rounds runs on: its input ``x``, the step's context
    ``ctx`` (masks, rotary tables), the autocast mode, the storages that are no tape
    (``held``: parameters and the context's tensors) and whether ``x`` takes a gradient
    (``input_grad``). Every round of the stage, timed or measured, whole or selective, runs
    on the same."""

    stage: nn.Module
    x: torch.Tensor
    ctx: dict[str, Any]
    autocast: AutocastMode
    held: set[int]
    input_grad: bool


_CACHE: dict[tuple, _Measured] = {}

MAX_TIMED_ROUNDS = 8  # the most rounds a stage is timed in, whatever ``Measuring.seconds``
# part of the key of the times a machine keeps (``_timing_key``): times kept before a
# selective backward's recomputation was timed inside it, or beside the host meter's RSS
# sampler, are measured again
TIMED_HOW = "recompute timed inside the backward; rounds timed without the RSS sampler"


# a forward that grew the RSS by this much is trimmed after before its taped round is measured
# (smaller ones are not: their growth would then be malloc's 128 KiB steps, not their tensors)
TRIM_BEFORE_TAPE = 64 << 20


def stage_parameters(stage: nn.Module) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if p.requires_grad]


def held_inputs(x0: Any, ctx: dict[str, Any]) -> tuple[int, int]:
    """Bytes of the chain's input ``x0`` (its storage, when a tensor) and of the step's
    context tensors that are not that storage: what the step holds throughout."""
    inputs = [x0] if isinstance(x0, torch.Tensor) else []
    x0_keys = {storage_key(t) for t in inputs}
    context = {storage_key(t): t.untyped_storage().nbytes() for t in context_tensors(ctx)
               if storage_key(t) not in x0_keys}
    return sum(t.untyped_storage().nbytes() for t in inputs), sum(context.values())


def profile_chain(chain: Chain, x0: torch.Tensor, ctx: dict[str, Any], autocast: AutocastMode,
                  measuring: Measuring, *,
                  resident: Callable[[list[nn.Parameter]], Any] | None = None,
                  log: Any = None) -> tuple[list[StageCost], int]:
    """Costs of every stage (parameter bytes are those the stage alone uses), measured as
    ``measuring`` says, and the bytes of gradients of parameters shared between stages (tied
    embeddings). ``resident(params)``, when given, is a context that holds a stage's weights
    while it runs (a model whose weights start on disk)."""
    resident = resident or (lambda params: contextlib.nullcontext())
    owners = _parameter_users(chain)
    shared = {key for key, users in owners.items() if len(users) > 1}
    # the frozen weights each stage alone holds, which streaming moves with its others
    movable = stage_parameters_to_stream(chain.stages)
    frozen = [sum(p.nbytes for p in movable.get(i, []) if not p.requires_grad)
              for i in range(len(chain.stages))]
    # parameters and the step's context (masks, rotary tables) are held anyway: not tape
    held = {storage_key(p) for stage in chain.stages for p in stage.parameters()}
    held |= {storage_key(t) for t in context_tensors(ctx)}
    shared_bytes = 0
    counted: set[int] = set()
    costs: list[StageCost] = []
    x = x0
    # whether anything so far trains: a stage's input needs a gradient only after that, and
    # a stage before it needs no backward at all (plan/forward_only.py)
    trains = x0.is_floating_point() and x0.requires_grad
    for i, stage in enumerate(chain.stages):
        input_grad = x.is_floating_point() and trains
        trains = trains or any(p.requires_grad for p in stage.parameters())
        key = (chain.signatures[i], tuple(x.shape), x.dtype, str(x.device), autocast, input_grad,
               measuring.selective)
        fresh = key not in _CACHE
        if fresh:
            started = time.perf_counter()
            timing_key = _timing_key(key, x.device, measuring)
            run = StageRun(stage, x, ctx, autocast, held, input_grad)
            with resident(list(stage.parameters())), Quiet() as quiet:
                # times this machine kept for the stage replace its own: only its bytes are
                # measured then, and its timed rounds (half or more of its rounds) are skipped
                kept = _recalled_times(timing_key)
                measured = _measure(run, measuring, timed=kept is None)
                if kept is not None and len(kept) != len(_own_times(measured)):
                    # kept for another variant: time it, and keep its own
                    measured, kept = _measure(run, measuring), None
            _CACHE[key] = _kept_times(measured, kept, timing_key, quiet.quiet)
            if log is not None:
                log(f"profiled {chain.names[i]} in {time.perf_counter() - started:.1f} s")
        m = _CACHE[key]
        own = 0
        for p in stage_parameters(stage):
            k = storage_key(p)
            if k in counted:
                continue
            counted.add(k)
            if k in shared:
                shared_bytes += p.nbytes
            else:
                own += p.nbytes
        costs.append(StageCost(name=chain.names[i], fwd_time=m.fwd_time, bwd_time=m.bwd_time,
                               param_bytes=own, output_bytes=m.output_bytes, tape=m.tape,
                               output_in_tape=m.output_in_tape, fwd_transient=m.fwd_transient,
                               fwd_transient_nograd=m.fwd_transient_nograd,
                               bwd_transient=m.bwd_transient, input_grad=input_grad,
                               largest_block=m.largest_block, frozen_bytes=frozen[i],
                               needs_backward=trains, selective=m.selective))
        if i + 1 < len(chain.stages):
            with resident(list(stage.parameters())):
                x = forward_plain(stage, x, ctx, autocast)
            if x.device.type == "cpu":
                # the forward's freed blocks back to the system: kept by malloc they add up
                # over the stages and the head is measured on top of them (a LoRA'd 1.1B
                # model's profile passed --ram 1GiB by 350 MiB of them)
                return_free_memory()
    return costs, shared_bytes


def _timing_key(key: tuple, device: torch.device, measuring: Measuring) -> str:
    """The key of a stage's kept times: its profile key, what computes it and how its rounds
    are timed (hashed: a signature holds the stage's whole repr)."""
    how = (key, device_model(device), measuring.repeats, measuring.seconds,
           measuring.timing is not None, TIMED_HOW)
    return hashlib.sha256(repr(how).encode()).hexdigest()[:24]


def _own_times(measured: _Measured) -> list[float]:
    """The times a machine keeps of a stage: its forward's, its backward's and its selective
    variant's recomputation where it has one."""
    own = [measured.fwd_time, measured.bwd_time]
    if measured.selective is not None:
        own.append(measured.selective.recompute_time)
    return own


def _recalled_times(key: str) -> list[float] | None:
    """The times this machine kept for ``key``, or None."""
    times = recalled("stage", key)
    if isinstance(times, list) and times and all(
            isinstance(t, (int, float)) and t >= 0 for t in times):
        return times
    return None


def _kept_times(measured: _Measured, kept: list[float] | None, key: str,
                quiet: bool) -> _Measured:
    """``measured`` with the times ``kept`` for ``key`` on this machine in place of its own
    (``profile/machine.py``'s kept figures: every process plans from the same ones), or, with
    none kept, its own, kept when other processes left the CPUs quiet and its rounds were
    timed; its bytes are its own either way."""
    if kept is None:
        if quiet and measured.timed:
            keep("stage", key, _own_times(measured))
        return measured
    selective = measured.selective
    if selective is not None:
        selective = replace(selective, recompute_time=kept[2])
    return replace(measured, fwd_time=kept[0], bwd_time=kept[1], selective=selective)


def _measure(run: StageRun, measuring: Measuring, timed: bool = True) -> _Measured:
    """The stage's rounds (``_rounds``) and, when ``measuring.selective`` and the stage is not
    compiled, those of its selective variant: kept when the stage can run so
    (``SelectiveUnsupported``), keeps something (a stage without matmuls that autograd
    records would recompute all of itself) and less than the whole tape. The variant's
    warm-up round tells which, and a variant that does not qualify runs no more rounds
    (W1's fused LM head, whose forward records no matmul, spent 6 rounds and 70% of its
    profile on a variant it then dropped). Its recomputation is timed inside its backward;
    on an accelerator, where that times the launches only, it is at least what its backward takes beyond the whole tape's backward (that
    difference alone was noise around zero on 2 cores, and priced the W2 layer's selective
    backward free). ``timed`` False: its memory rounds only (their times are not the
    stage's)."""
    whole = _rounds(run, measuring, False, timed=timed)
    if not measuring.selective or is_compiled(run.stage):
        return whole
    try:
        part = _rounds(run, measuring, True, timed=timed,
                       qualifies=lambda first: 0 < first.tape < whole.tape)
    except SelectiveUnsupported:
        return whole
    if part is None or not 0 < part.tape < whole.tape:
        return whole
    recompute = part.recompute_time
    if not isinstance(measuring.meter, HostMeter):
        recompute = max(recompute, part.bwd_time - whole.bwd_time)
    return replace(whole, selective=SelectiveCost(
        tape=part.tape, recompute_time=recompute,
        fwd_transient=part.fwd_transient, bwd_transient=part.bwd_transient))


def _rounds(run: StageRun, measuring: Measuring, selective: bool, *, timed: bool = True,
            qualifies: Callable[[_Measured], bool] | None = None) -> _Measured | None:
    """Memory from ``measuring.repeats`` rounds after a warm-up round (run selectively when
    ``selective``); times (medians) from as many rounds of their own, then from more rounds
    until they took ``measuring.seconds``. The timed rounds run without the host meter's
    RSS sampler, as steps do (``timing_meter``), and inside ``measuring.timing`` when given
    (a context that sets the allocator the steps will run with) after one more warm-up
    round. A meter without a sampler (an accelerator's) times its memory rounds. Memory
    measured apart from times on the host (a RAM budget is at stake) counts tensor bytes
    too. None, after the warm-up round alone, when ``qualifies`` says that round's
    measure does not. ``timed`` False: no rounds of their own for the times (the memory
    rounds' stand, ``_Measured.timed`` False)."""
    meter, repeats, timing = measuring.meter, measuring.repeats, measuring.timing
    counted = timing is not None and isinstance(meter, HostMeter) and not is_compiled(run.stage)
    ledger = TensorLedger() if counted else None
    with ledger if ledger is not None else contextlib.nullcontext():
        warm_up = measure_round(run, meter, ledger, selective)
        if qualifies is not None and not qualifies(warm_up):
            return None
        memory = [measure_round(run, meter, ledger, selective) for _ in range(repeats)]
    clock = timing_meter(meter)
    one = lambda: measure_round(run, clock, None, selective)  # noqa: E731
    rounds = list(memory)
    if timed:
        with timing() if timing is not None else contextlib.nullcontext():
            if timing is not None:
                rounds = [one() for _ in range(repeats + 1)][1:]
            elif clock is not meter:
                rounds = [one() for _ in range(repeats)]
            while (len(rounds) < MAX_TIMED_ROUNDS
                   and sum(r.fwd_time + r.bwd_time for r in rounds) < measuring.seconds):
                rounds.append(one())
    last = memory[-1]
    return _Measured(fwd_time=statistics.median(r.fwd_time for r in rounds),
                     bwd_time=statistics.median(r.bwd_time for r in rounds),
                     recompute_time=statistics.median(r.recompute_time for r in rounds),
                     timed=timed,
                     output_bytes=last.output_bytes, tape=last.tape,
                     output_in_tape=last.output_in_tape,
                     fwd_transient=max(r.fwd_transient for r in memory),
                     fwd_transient_nograd=max(r.fwd_transient_nograd for r in memory),
                     bwd_transient=max(r.bwd_transient for r in memory),
                     largest_block=max(r.largest_block for r in memory))


def timing_meter(meter: HostMeter | DeviceMeter) -> HostMeter | DeviceMeter:
    """The meter rounds are timed with: a host meter without its RSS sampler (steps run
    without one, and its wake-ups slow the kernels on a small machine), else ``meter``."""
    if isinstance(meter, HostMeter) and meter.interval is not None:
        return HostMeter(interval=None)
    return meter


class _Window:
    """The peak growth of the tier's bytes over a part of a round: the meter's, and no less
    than the tensor bytes ``ledger`` counted (the host meter's samples can miss a peak)."""

    def __init__(self, meter: HostMeter | DeviceMeter, ledger: TensorLedger | None) -> None:
        self.meter = meter
        self.ledger = ledger
        self.base = meter.current()
        meter.reset_peak()
        if ledger is not None:
            ledger.restart()

    def growth(self) -> int:
        grown = self.meter.peak() - self.base
        return grown if self.ledger is None else max(grown, self.ledger.peak)

    def largest(self) -> int:
        """The largest tensor allocated in the window (0 without a ledger)."""
        return 0 if self.ledger is None else self.ledger.largest


def measure_round(run: StageRun, meter: HostMeter | DeviceMeter, ledger: TensorLedger | None,
                  selective: bool = False) -> _Measured:
    """One round of ``run.stage`` on ``run.x``: a forward without a tape, one with
    (``selective``: run selectively) and its backward, timed and measured by ``meter`` and,
    when given, ``ledger`` (whose dispatch mode must be active)."""
    stage, x, ctx, autocast = run.stage, run.x, run.ctx, run.autocast
    params = stage_parameters(stage)
    window = _Window(meter, ledger)
    y = forward_plain(stage, x, ctx, autocast)
    out_bytes = y.untyped_storage().nbytes()
    nograd_transient = window.growth() - out_bytes
    largest = window.largest()
    del y
    if isinstance(meter, HostMeter) and out_bytes + nograd_transient >= TRIM_BEFORE_TAPE:
        # the forward's freed blocks back to the system, as the executor's HostRoom gives
        # them back before a large operation near the budget: kept by malloc, the taped
        # forward reuses them and grows the RSS less than it will in the step (llama-134m's
        # LM head: 20-35 MiB less, and `tierflow compare` measured 102% of its budget)
        return_free_memory()

    window = _Window(meter, ledger)
    start = time.perf_counter()
    taped = forward_taped(stage, x, ctx, autocast, input_grad=run.input_grad,
                          selective=selective)
    meter.finish()
    fwd_time = time.perf_counter() - start
    tape = tape_bytes(taped, run.held)
    output_in_tape = storage_key(taped.y) in taped.saved
    tape_transient = window.growth() - out_bytes - tape
    largest = max(largest, window.largest())

    grad_y = _unit_gradient(taped.y)
    inputs = ([taped.xin] if taped.xin.requires_grad else []) + params
    window = _Window(meter, ledger)
    start = time.perf_counter()
    grads = torch.autograd.grad(taped.y, inputs, grad_y, allow_unused=True) if inputs else ()
    meter.finish()
    bwd_time = time.perf_counter() - start
    made = sum(g.nbytes for g in grads if g is not None)
    bwd_transient = window.growth() - made
    largest = max(largest, window.largest())
    recompute_time = taped.policy.recompute_seconds if taped.policy is not None else 0.0
    return _Measured(fwd_time=fwd_time, bwd_time=bwd_time, recompute_time=recompute_time,
                     output_bytes=out_bytes, tape=tape,
                     output_in_tape=output_in_tape, fwd_transient=max(0, tape_transient),
                     fwd_transient_nograd=max(0, nograd_transient),
                     bwd_transient=max(0, bwd_transient), largest_block=largest)


def _unit_gradient(y: torch.Tensor) -> torch.Tensor:
    """A gradient for y with its shape (ones: the loss's own gradient for a scalar)."""
    return torch.ones_like(y) if y.is_floating_point() else torch.zeros_like(y, dtype=torch.float32)


def _parameter_users(chain: Chain) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for i, stage in enumerate(chain.stages):
        for p in stage_parameters(stage):
            users.setdefault(storage_key(p), []).append(i)
    return users
