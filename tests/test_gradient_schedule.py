"""The gradient transfers a plan places among its ops when updates are deferred
(plan/gradient_schedule.py): each streamed stage's gradients stored after its backward's
Update and loaded before their next use, priced on the resources they name, carried
through the plan's JSON. Pure data."""
import pytest

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.gradient_schedule import GRADS
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Backward, Forward, Load, Store, Update
from tierflow.plan.plan import Plan
from tierflow.plan.timeline import timeline
from tierflow.plan.transfers import Transfers

STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=30)
STEP = (Forward(0, True), Forward(1, True), Forward(2, True),
        Backward(2), Update(2), Backward(1), Update(1), Backward(0), Update(0))


def _costs(bytes_per_s: float) -> ChainCosts:
    return ChainCosts(stages=(STAGE,) * 3, input_bytes=10, static_bytes=1000,
                      optimizer_owned=True,
                      bandwidths={"disk read": bytes_per_s, "disk write": bytes_per_s})


def _grads(stages, read_ahead: bool = True) -> KeptBelow:
    return KeptBelow(GRADS, tuple((i, 100) for i in stages), "disk", "ram", "disk read",
                     "disk write", read_ahead)


def _placed(stages, accumulates: bool, bytes_per_s: float = 1e6,
            read_ahead: bool = True) -> Plan:
    plan = Plan(strategy="keep-all", ops=STEP, costs=_costs(bytes_per_s))
    return plan.with_transfers(Transfers(update_order=(2, 1, 0),
                                         gradients=_grads(stages, read_ahead),
                                         accumulates=accumulates))


def _shape(ops):
    return [str(op) if not isinstance(op, (Load, Store)) else
            f"{type(op).__name__}{op.stage}" for op in ops]


def test_each_streamed_stage_stores_after_its_update_and_loads_before_its_next_use():
    """Accumulating, read when needed: a stage's gradients come back right before its
    backward (autograd adds to them) and go down right after its Update; the update pass
    reads them before it."""
    placed = _placed({1, 2}, accumulates=True, read_ahead=False)
    assert _shape(placed.ops) == [
        "Fall(0)", "Fall(1)", "Fall(2)", "Load2", "B(2)", "U(2)", "Store2", "Load1", "B(1)",
        "U(1)", "Store1", "B(0)", "U(0)"]
    assert _shape(placed.routines.update_pass) == ["Load2", "U(2)", "Load1", "U(1)", "U(0)"]
    assert all(op.what == GRADS and op.resource == ("disk read" if isinstance(op, Load)
                                                    else "disk write")
               for op in (*placed.ops, *placed.routines.update_pass)
               if isinstance(op, (Load, Store)))


def test_without_accumulation_nothing_is_read_back_before_a_backward():
    """Clipping alone (one micro-batch): the gradients go down and come back for the pass."""
    placed = _placed({0, 1, 2}, accumulates=False)
    assert not any(isinstance(op, Load) for op in placed.ops)
    assert [op.stage for op in placed.ops if isinstance(op, Store)] == [2, 1, 0]
    assert [op.stage for op in placed.routines.update_pass if isinstance(op, Load)] == [2, 1, 0]


def test_the_gradient_pass_load_follows_its_weights_load():
    """In an update pass that reads a stage's weights, its gradients are read beside them
    (as far ahead), not at its update."""
    from tierflow.plan.gradient_schedule import with_gradient_reads
    from tierflow.plan.ops import WEIGHTS
    w = [Load(WEIGHTS, i, "disk", "ram", "disk read", 100) for i in range(2)]
    out = with_gradient_reads((w[1], w[0], Update(1), Update(0)), _grads({0, 1}))
    assert _shape(out) == ["Load1", "Load1", "Load0", "Load0", "U(1)", "U(0)"]
    assert [op.what for op in out[:4]] == [WEIGHTS, GRADS, WEIGHTS, GRADS]


@pytest.mark.parametrize("accumulates", [True, False])
def test_the_timeline_prices_the_gradients_on_the_disk(accumulates):
    """A fast disk hides the writes behind the next backward; a slow one makes the next
    write and (accumulating) the backward that reads them back wait; the moves are spans
    on ``disk write`` and ``disk read``. (Read ahead, only the first backward waits for a
    fast disk's read.)"""
    compute = 3 * (STAGE.fwd_time + STAGE.bwd_time)
    fast = _placed({1, 2}, accumulates, 1e6)
    assert fast.predicted_time == pytest.approx(compute + (1e-4 if accumulates else 0.0))
    slow = _placed({1, 2}, accumulates, 10.0)  # 10 s a stage's gradients each way
    line = slow.timeline
    assert line.busy("disk write") == pytest.approx(20.0)
    assert line.busy("disk read") == pytest.approx(20.0 if accumulates else 0.0)
    # accumulating: both reads (20 s) run before stage 1's backward, the reads overlapping
    # only the forwards' last second and stage 2's backward; then stage 1's Store waits for
    # stage 2's
    assert line.time >= compute + (18.0 if accumulates else 1.0)
    update_pass = timeline(slow.costs, slow.routines.update_pass)
    assert update_pass.busy("disk read") == pytest.approx(20.0)


def test_the_plan_carries_its_gradients_through_json():
    placed = _placed({1, 2}, accumulates=True)
    back = Plan.from_json(placed.to_json())
    assert back.ops == placed.ops and back.routines == placed.routines
    assert back.transfers == placed.transfers
    assert placed.decisions()["gradients"] == [1, 2]
    assert placed.decisions()["gradients_home"] == "disk"
    assert placed.decisions()["transfer_ops"] == {"grads": {"load": 4, "store": 2}}
    assert '"what": "grads"' in placed.to_json()


def test_reading_ahead_a_stage_s_gradients_come_back_during_the_backward_before():
    """Read ahead, stage 1's gradients are read while stage 2's backward runs (the first
    backward's right before it), so a disk as slow as a backward makes nothing wait for
    them but that first read."""
    ahead = _placed({1, 2}, accumulates=True, bytes_per_s=50.0)  # 2 s a stage's gradients
    assert _shape(ahead.ops) == [
        "Fall(0)", "Fall(1)", "Fall(2)", "Load2", "Load1", "B(2)", "U(2)", "Store2", "B(1)",
        "U(1)", "Store1", "B(0)", "U(0)"]
    needed = _placed({1, 2}, accumulates=True, bytes_per_s=50.0, read_ahead=False)
    compute = 3 * (STAGE.fwd_time + STAGE.bwd_time)
    # each read waits 2 s on demand, and stage 1's waits 2 s more behind stage 2's write
    # (the disk's reads and writes take turns)
    assert needed.predicted_time == pytest.approx(compute + 6.0)
    assert ahead.predicted_time == pytest.approx(compute + 2.0)


def test_gradients_read_back_are_held_from_their_load():
    """The simulation counts a stage's gradients from the Load that reads them back (its
    backward adds to them, making none), so reading ahead costs memory while it overlaps."""
    for read_ahead in (True, False):
        placed = _placed({1, 2}, accumulates=True, read_ahead=read_ahead)
        events = placed.simulation.timeline
        for before, event in zip(events, events[1:]):
            if event.op.startswith("load(g"):
                assert event.resident - before.resident == 100
        assert placed.simulation.peak == _placed({1, 2}, False).simulation.peak + \
            (100 if read_ahead else 0)


def test_the_first_micro_batch_of_a_step_is_priced_without_its_gradient_reads():
    """Its Loads read nothing (none were written yet): ``step_time`` prices the first
    micro-batch without them and every other as the plan's ops stand."""
    slow = _placed({1, 2}, accumulates=True, bytes_per_s=50.0)
    compute = 3 * (STAGE.fwd_time + STAGE.bwd_time)
    assert slow.step_time(1) == pytest.approx(compute)
    assert slow.step_time(4) == pytest.approx(compute + 3 * slow.predicted_time)
    plain = _placed({1, 2}, accumulates=False, bytes_per_s=50.0)
    assert plain.step_time(3) == pytest.approx(3 * plain.predicted_time)
