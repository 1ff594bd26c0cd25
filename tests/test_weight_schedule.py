"""The weight transfers a plan places among its ops (plan/weight_schedule.py) and their price
as a task graph on resources (plan/timeline.py). Pure data."""
import itertools

import pytest
from schedules import step_seconds, streaming

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Backward, Drop, Exchange, Forward, Load, Reduce, Store, Update
from tierflow.plan.plan import Plan
from tierflow.plan.rotor import rotor, smallest_budget
from tierflow.plan.strategies import checkpoint_all, keep_all
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.state_schedule import STATES
from tierflow.plan.timeline import timeline
from tierflow.plan.transfers import Transfers
from tierflow.plan.weight_schedule import check_schedule, schedule_weights

STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=30, update_time=0.5)


def _costs(length: int = 5) -> ChainCosts:
    return ChainCosts(stages=(STAGE,) * length, input_bytes=10, static_bytes=1000,
                      optimizer_owned=True, bandwidths={"disk read": 100.0,
                                                        "disk write": 100.0})


def _plans(costs: ChainCosts) -> dict[str, tuple]:
    return {"keep-all": tuple(keep_all(costs)), "checkpoint-all": tuple(checkpoint_all(costs)),
            "rotor": tuple(rotor(costs, smallest_budget(costs), slots=None))}


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("planner", ["keep-all", "checkpoint-all", "rotor"])
@pytest.mark.parametrize("deferred", [False, True])
def test_every_routine_runs_with_its_weights_in_memory(planner, depth, deferred):
    """Whatever the compute ops and the depth, each op list finds the weights its ops use in
    memory, reads only what is not, and ends where the next list starts (checked by the
    plan itself as it is made), with every streamed stage's weights written back once per
    step (inside the backward, or in the update pass)."""
    costs = _costs()
    streamed = {1, 2, 3, 4} if planner != "rotor" else {0, 2, 4}
    order = (4, 3, 2, 1, 0) if deferred else None
    for tapes_below, host in itertools.product((frozenset(), frozenset({1, 2})),
                                               (frozenset(), frozenset({2}))):
        if deferred and host:
            continue  # stepped in host RAM, a stage is left out of the update pass
        weights = streaming(costs, streamed, depth, written_back=not deferred,
                            tapes_below=tapes_below, host_updated=host)
        plan = Plan(planner, _plans(costs)[planner], costs).with_transfers(
            Transfers(weights, update_order=order))
        stores = [op.stage for op in (*plan.ops, *plan.routines.update_pass)
                  if isinstance(op, Store)]
        assert sorted(stores) == sorted(streamed - host)
        assert plan.evaluation_ops == plan.routines.evaluation


def test_a_plan_whose_ops_miss_a_read_is_refused():
    costs = _costs(3)
    weights = streaming(costs, {1, 2}, 0)
    plan = Plan("keep-all", tuple(keep_all(costs)), costs).with_transfers(Transfers(weights))
    without = tuple(op for op in plan.ops if not isinstance(op, Load))
    with pytest.raises(ValueError, match="without its stage's weights in memory"):
        Plan("keep-all", without, costs, routines=plan.routines, transfers=Transfers(weights))
    twice = (plan.routines.cold[0],) + plan.ops
    schedule = schedule_weights(plan.ops, weights, 3)
    with pytest.raises(ValueError, match="reads weights that are in memory"):
        check_schedule(type(schedule)(twice, *[getattr(schedule, f) for f in
                                                 ("between", "update_pass", "after_pass",
                                                  "cold", "evaluation", "boundary")]),
                       weights)


def test_a_plan_with_transfers_round_trips_through_json():
    costs = _costs()
    plan = Plan("checkpoint-all", tuple(checkpoint_all(costs)), costs).with_transfers(
        Transfers(streaming(costs, {1, 2, 3}, 1, written_back=False),
                  KeptBelow(STATES, ((4, 200), (3, 200), (1, 200)), "disk", "ram", "disk read",
                               "disk write", read_ahead=True),
                  update_order=(4, 3, 2, 1, 0)))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert "each step moves" in plan.explain()


def test_loads_wait_for_the_store_of_their_stage_and_compute_for_its_load():
    """The timeline: a Load of a stage starts only once its last Store is done; an op of a
    streamed stage starts only once its Load is done; a Store or Load overlaps compute."""
    costs = _costs(2)
    ops = (Load("weights", 1, "disk", "ram", "disk read", 300),  # 3 s
           Forward(0, tape=True), Forward(1, tape=True), Backward(1), Update(1),
           Store("weights", 1, "ram", "disk", "disk write", 500),  # 5 s
           Backward(0), Update(0), Drop("weights", 1, "ram"))
    line = timeline(costs, ops)
    spans = {s.name: s for s in line.spans}
    assert spans["Fall(1)"].start == pytest.approx(spans["load(w1 disk>ram)"].end)
    store = spans["store(w1 ram>disk)"]
    assert store.start == pytest.approx(spans["U(1)"].end)
    assert spans["B(0)"].start == pytest.approx(store.start)  # beside the write
    # the drop holds the dispatcher until the write is done: the next repetition (and its
    # load of the stage) starts then
    assert line.time == pytest.approx(store.end)
    assert line.busy("disk read") == pytest.approx(3.0)


def test_a_disks_reads_and_writes_take_turns_and_a_links_copies_do_not():
    """A Load queued behind a Store on the disk starts once it ends (one device, its
    bandwidth either way); on a GPU's link the same two run side by side."""
    ops = (Forward(0, tape=True), Backward(0),
           Store("weights", 0, "ram", "disk", "disk write", 500),  # 5 s
           Load("weights", 1, "disk", "ram", "disk read", 300),  # 3 s
           Drop("weights", 0, "ram"))  # waits for the write: no backlog into the next step
    spans = {s.name: s for s in timeline(_costs(2), ops).spans}
    assert spans["load(w1 disk>ram)"].start == pytest.approx(spans["store(w0 ram>disk)"].end)
    link = ChainCosts(stages=(STAGE,) * 2, input_bytes=10, static_bytes=1000,
                      optimizer_owned=True, bandwidths={"copy up": 100.0, "copy down": 100.0})
    ops = (Forward(0, tape=True), Backward(0),
           Store("weights", 0, "gpu", "ram", "copy down", 500),
           Load("weights", 1, "ram", "gpu", "copy up", 300), Drop("weights", 0, "gpu"))
    spans = {s.name: s for s in timeline(link, ops).spans}
    assert spans["load(w1 ram>gpu)"].start == pytest.approx(spans["store(w0 gpu>ram)"].start)


def test_an_exchange_holds_the_step_and_a_reduce_does_not():
    """The step waits for an Exchange (what it returns decides what runs next), not for a
    Reduce (what needs the stage's gradients waits for it)."""
    costs = ChainCosts(stages=(STAGE,) * 2, input_bytes=10, static_bytes=1000,
                       optimizer_owned=True, bandwidths={"network": 100.0})
    ops = (Forward(0, tape=True), Forward(1, tape=True), Backward(1),
           Reduce(1, "network", 300),  # 3 s
           Backward(0), Exchange("loss", "network", 200),  # 2 s, after the reduce
           Update(0))
    spans = {s.name: s for s in timeline(costs, ops).spans}
    assert spans["B(0)"].start == pytest.approx(spans["B(1)"].end)  # beside the reduce
    assert spans["exchange(loss)"].start == pytest.approx(spans["reduce(g1)"].end)
    assert spans["U(0)"].start == pytest.approx(spans["exchange(loss)"].end)


def test_compute_ops_alone_cost_their_stages():
    costs = _costs()
    plan = Plan("rotor", _plans(costs)["rotor"], costs)
    assert plan.predicted_time == pytest.approx(plan.simulation.time)


def test_depth_hides_reads_in_a_training_step():
    """The same training ops with reads on demand, one ahead and two ahead: reading ahead
    hides reads behind compute, never costs time, and with reads shorter than a stage's
    compute a step costs its compute plus the reads no compute can hide."""
    costs = _costs()
    ops = _plans(costs)["checkpoint-all"]
    seconds = [step_seconds(costs, ops, {1, 2, 3, 4}, d, 200.0) for d in (0, 1, 2)]
    compute = timeline(costs, ops).time
    assert seconds[0] > seconds[1] >= seconds[2] >= compute
    assert seconds[0] - compute >= 2.0  # reads wait on demand (0.5 s each)
