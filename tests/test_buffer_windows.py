"""The static buffers of transfers that some ops run without (plan/buffer_windows.py), as the
plan's simulation counts them: one stage's optimizer states between the step before's last
write of states and the step's first, one tape's outside the window from the first tape read
to the end of the last tape write. Pure data."""
from dataclasses import replace

import pytest

from tierflow.plan.buffer_windows import unheld_bytes
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Forward, Load, Store
from tierflow.plan.plan import Plan
from tierflow.plan.state_schedule import STATES
from tierflow.plan.strategies import keep_all
from tierflow.plan.tape_schedule import TAPE
from tierflow.plan.transfers import Transfers

STATE_BYTES = 400  # each stage's optimizer states on the disk
TAPE_BYTES = 30  # each stage's tape (its activations)
STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=TAPE_BYTES, fwd_transient=1500, update_time=0.5,
                  update_transient=STATE_BYTES)  # its states, read back, while it updates


def _states_plan(write_bytes_per_s: float, buffer: int = STATE_BYTES) -> Plan:
    """Keep-all on four stages whose states live on the disk, read ahead: two stages' states
    in flight in the static bytes, one of them a buffer the plan may count free."""
    first = replace(STAGE, name="embed", fwd_transient=50)
    costs = ChainCosts(stages=(first,) + (STAGE,) * 3, input_bytes=10,
                       static_bytes=1000 + 2 * STATE_BYTES, optimizer_owned=True,
                       state_buffer_bytes=buffer,
                       bandwidths={"disk read": 1000.0, "disk write": write_bytes_per_s})
    states = KeptBelow(STATES, tuple((i, STATE_BYTES) for i in range(4)), "disk", "ram",
                       "disk read", "disk write", True)
    return Plan("keep-all", tuple(keep_all(costs)), costs).with_transfers(
        Transfers(states=states))


def _without_windows(plan: Plan) -> Plan:
    return replace(plan, costs=replace(plan.costs, state_buffer_bytes=0, tape_buffer_bytes=0))


def _first(plan: Plan, kind: type, what: str) -> int:
    return next(p for p, op in enumerate(plan.ops) if isinstance(op, kind) and op.what == what)


def _differences(plan: Plan) -> list[tuple[int, int]]:
    """Per op, how much less the plan holds after it and at its peak than with every buffer
    held."""
    return [(whole.resident - free.resident, whole.peak - free.peak) for free, whole in
            zip(plan.simulation.timeline, _without_windows(plan).simulation.timeline)]


def test_one_state_buffer_is_free_from_the_last_write_to_the_first_read():
    """A fast disk: the last write of a step ends during the next step's first forward, so
    from the second forward to the first read or write of states one buffer is free."""
    plan = _states_plan(write_bytes_per_s=1000.0)
    first = min(_first(plan, Load, STATES), _first(plan, Store, STATES))
    assert _differences(plan) == [(STATE_BYTES,) * 2 if 1 <= p < first else (0, 0)
                                  for p in range(len(plan.ops))]
    # the peak is a forward's here (its transient passes a stage's states while it updates)
    events = plan.simulation.timeline
    top = max(range(len(events)), key=lambda p: events[p].peak)
    assert 1 <= top < first
    assert plan.predicted_peak == plan.costs.static_bytes + events[top].peak \
        < _without_windows(plan).predicted_peak


def test_a_state_write_that_outlasts_the_step_keeps_its_buffer_into_the_next_forwards():
    """A slow disk: the last write runs on into the next step's forwards, which hold both
    buffers until the first compute op that starts after it."""
    slow = _states_plan(write_bytes_per_s=150.0)
    line = slow.timeline
    every = (*slow.ops, *slow.routines.between)
    last_write = max(s.end for s in line.spans if isinstance(every[s.position], Store))
    starts = {s.position: s.start for s in line.spans}
    free = [p for p, (after, _) in enumerate(_differences(slow)) if after]
    assert free and isinstance(slow.ops[free[0]], Forward)
    assert starts[free[0]] >= last_write - line.time > starts[free[0] - 1]


def _tapes_plan(read_ahead: bool, write_bytes_per_s: float = 100.0) -> Plan:
    """Keep-all on four stages whose middle two tapes go to the disk: two tapes in flight in
    the static bytes when read ahead."""
    costs = ChainCosts(stages=(STAGE,) * 4, input_bytes=10,
                       static_bytes=1000 + (2 if read_ahead else 1) * TAPE_BYTES,
                       optimizer_owned=True,
                       tape_buffer_bytes=TAPE_BYTES if read_ahead else 0,
                       bandwidths={"disk read": 100.0, "disk write": write_bytes_per_s})
    tapes = KeptBelow(TAPE, ((1, TAPE_BYTES), (2, TAPE_BYTES)), "disk", "ram", "disk read",
                      "disk write", read_ahead)
    return Plan("keep-all", tuple(keep_all(costs)), costs).with_transfers(
        Transfers(tapes=tapes))


@pytest.mark.parametrize("write_bytes_per_s, overlap", [(100.0, False), (10.0, True)])
def test_one_tape_buffer_is_free_outside_the_reads_and_writes_of_tapes(write_bytes_per_s,
                                                                       overlap):
    """Before the first tape read only a write can be in flight, and once the last write
    ended only a read: one tape's buffer is free there, both are held in between (a slow
    disk's last write runs beside the first read; a fast one's ends before it)."""
    plan = _tapes_plan(read_ahead=True, write_bytes_per_s=write_bytes_per_s)
    line = plan.timeline
    every = (*plan.ops, *plan.routines.between)
    last_write = max(s.end for s in line.spans if isinstance(every[s.position], Store))
    written = next(s.position for s in line.spans
                   if s.resource == "compute" and s.start >= last_write)
    first_read = _first(plan, Load, TAPE)
    assert (first_read < written) == overlap
    assert _differences(plan) == [(0, 0) if first_read <= p < written else (TAPE_BYTES,) * 2
                                  for p in range(len(plan.ops))]


@pytest.mark.parametrize("make", [lambda: _states_plan(1000.0, buffer=0),
                                  lambda: _tapes_plan(read_ahead=False)])
def test_costs_that_name_no_buffer_hold_their_static_bytes_throughout(make):
    """No states below (or stepped where they live), or tapes read on demand: the costs name
    no buffer and every op holds the static bytes."""
    plan = make()
    assert unheld_bytes(plan.costs, plan.ops, plan.routines.between, plan.timeline) is None
    assert plan.predicted_peak == plan.simulation.peak + plan.costs.static_bytes
