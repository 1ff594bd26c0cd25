"""The optimizer states in flight on the compute tier (plan/simulate.py, Plan.simulation):
their buffers are static bytes, but between the step before's last write of states and the
step's first read the plan counts one stage's fewer. Pure data."""
from dataclasses import replace

import pytest

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Forward, Load, Store
from tierflow.plan.plan import Plan
from tierflow.plan.state_schedule import STATES
from tierflow.plan.strategies import keep_all
from tierflow.plan.transfers import Transfers

STATE_BYTES = 400  # each stage's optimizer states on the disk
STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=30, fwd_transient=1500, update_time=0.5,
                  update_transient=STATE_BYTES)  # its states, read back, while it updates


def _plan(write_bytes_per_s: float, read_ahead: bool = True, buffer: int = STATE_BYTES
          ) -> Plan:
    """Keep-all on four stages whose states live on the disk: two stages' states in flight
    in the static bytes, one of them a buffer the plan may count free."""
    first = replace(STAGE, name="embed", fwd_transient=50)
    costs = ChainCosts(stages=(first,) + (STAGE,) * 3, input_bytes=10,
                       static_bytes=1000 + (2 if read_ahead else 1) * STATE_BYTES,
                       optimizer_owned=True, state_buffer_bytes=buffer,
                       bandwidths={"disk read": 1000.0, "disk write": write_bytes_per_s})
    states = KeptBelow(STATES, tuple((i, STATE_BYTES) for i in range(4)), "disk", "ram",
                       "disk read", "disk write", read_ahead)
    return Plan("keep-all", tuple(keep_all(costs)), costs).with_transfers(
        Transfers(states=states))


def test_the_forward_holds_one_state_buffer_fewer_once_the_last_write_is_done():
    """A fast disk: the last write of a step ends during the next step's first forward, so
    every op from the second forward to the first read of states holds one buffer fewer, and
    the others as many as the static bytes say."""
    plan = _plan(write_bytes_per_s=1000.0)
    held = replace(plan, costs=replace(plan.costs, state_buffer_bytes=0))
    first_read = next(p for p, op in enumerate(plan.ops)
                      if isinstance(op, Load) and op.what == STATES)
    assert plan.states_written() == 1
    for position, (free, whole) in enumerate(zip(plan.simulation.timeline,
                                                 held.simulation.timeline)):
        fewer = STATE_BYTES if 1 <= position < first_read else 0
        assert (whole.resident - free.resident, whole.peak - free.peak) == (fewer, fewer), \
            plan.ops[position]
    # the peak is a forward's here (its transient passes a stage's states while it updates)
    events = plan.simulation.timeline
    top = max(range(len(events)), key=lambda p: events[p].peak)
    assert 1 <= top < first_read
    assert plan.predicted_peak == plan.costs.static_bytes + events[top].peak < held.predicted_peak


def test_a_write_that_outlasts_the_step_keeps_its_buffer_into_the_next_forward():
    """A slow disk: the last write runs on into the next step's first forwards, which the
    plan counts with both buffers."""
    fast, slow = _plan(write_bytes_per_s=1000.0), _plan(write_bytes_per_s=150.0)
    written = slow.states_written()
    assert written is not None and written > 0
    assert isinstance(slow.ops[written], Forward)
    line = slow.timeline
    ops = (*slow.ops, *slow.routines.between)
    last_write = max(s.end for s in line.spans if isinstance(ops[s.position], Store))
    starts = {s.position: s.start for s in line.spans}
    assert starts[written] >= last_write - line.time > starts[written - 1]
    held = replace(slow, costs=replace(slow.costs, state_buffer_bytes=0))
    for position in range(written):
        assert slow.simulation.timeline[position] == held.simulation.timeline[position]
    assert fast.states_written() == 1


@pytest.mark.parametrize("read_ahead", [True, False])
def test_no_buffer_counted_free_without_states_below(read_ahead):
    """Costs that name no buffer (no states below, or stepped where they live) simulate as
    their static bytes say."""
    plan = _plan(1000.0, read_ahead, buffer=0)
    assert plan.states_written() is None
    assert plan.predicted_peak == plan.simulation.peak + plan.costs.static_bytes
