"""Updates run by the host optimizer say so in the plan (``Update(i, resource)``): inside
the backward, or first in a deferred update pass, with no weight transfers of their own
there; the gradients they take move by the plan's Store (down to host RAM) and Load (from
disk into it); the executor builds its host steps from those ops. Pure data, but for one
check of the host step's side on the CPU."""
import pytest

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.gradient_schedule import GRADS
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import COMPUTE, HOST_OPTIMIZER, WEIGHTS, Backward, Forward, Load, Update
from tierflow.plan.plan import Plan
from tierflow.plan.transfers import Transfers
from tierflow.plan.weight_schedule import StreamedWeights

STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=30)
STEP = (Forward(0, True), Forward(1, True), Forward(2, True),
        Backward(2), Update(2), Backward(1), Update(1), Backward(0), Update(0))


def _plan() -> Plan:
    costs = ChainCosts(stages=(STAGE,) * 3, input_bytes=10, static_bytes=1000,
                       optimizer_owned=True,
                       bandwidths={"copy up": 1e6, "copy down": 1e6})
    return Plan(strategy="keep-all", ops=STEP, costs=costs)


def _streamed(host, deferred: bool) -> StreamedWeights:
    return StreamedWeights(tuple((i, 100, 100) for i in range(3)), "ram", "gpu", "copy up",
                           "copy down", depth=1, written_back=not deferred,
                           host_updated=frozenset(host))


def test_updates_inside_the_backward_name_the_host_optimizer():
    placed = _plan().with_transfers(Transfers(host_stages=frozenset({1, 2})))
    updates = [op for op in placed.ops if isinstance(op, Update)]
    assert [(op.stage, op.resource) for op in updates] == [
        (2, HOST_OPTIMIZER), (1, HOST_OPTIMIZER), (0, COMPUTE)]
    assert placed.host_updated_stages == frozenset({1, 2})
    assert placed.decisions()["host_steps"] == [1, 2]
    assert str(updates[0]) == "Uh(2)" and str(updates[2]) == "U(0)"
    back = Plan.from_json(placed.to_json())
    assert back.ops == placed.ops and back.transfers == placed.transfers


def test_a_deferred_pass_steps_the_host_stages_first_without_moving_their_weights():
    """Deferred: the micro-batch's Updates only complete gradients (compute); the pass hands
    the host stages over first, reading and writing back only the others' weights."""
    placed = _plan().with_transfers(Transfers(
        weights=_streamed({1, 2}, deferred=True), update_order=(2, 1, 0),
        host_stages=frozenset({1, 2})))
    assert all(op.resource == COMPUTE for op in placed.ops if isinstance(op, Update))
    passed = placed.routines.update_pass
    updates = [op for op in passed if isinstance(op, Update)]
    assert [(op.stage, op.on_host) for op in updates] == [(2, True), (1, True), (0, False)]
    moved = {op.stage for op in passed if hasattr(op, "what") and op.what == WEIGHTS}
    assert moved <= {0}
    assert placed.host_updated_stages == frozenset({1, 2})
    assert not any(isinstance(op, Load) and op.stage in (1, 2) for op in passed)
    assert Plan.from_json(placed.to_json()).routines == placed.routines


def test_the_timeline_runs_host_steps_on_their_own_resource():
    """A host Update's hand-over (its gradients down) runs on compute, its step on the host
    optimizer beside the next stage's backward; the next hand-over waits for a step that
    outlasts that compute, and the end of the backward for the last step."""
    from dataclasses import replace

    plan = _plan()
    host = replace(STAGE, update_time=0.5, host_update_time=3.0)
    costs = replace(plan.costs, stages=(host,) * 3)
    placed = replace(plan, costs=costs).with_transfers(Transfers(host_stages=frozenset({1, 2})))
    line = placed.timeline
    assert line.busy(HOST_OPTIMIZER) == 6.0
    assert line.busy(COMPUTE) == 3 * (1.0 + 2.0) + 2 * 0.5 + 0.5  # U(0) on compute: 0.5
    # F 3 s, B(2) 2 s, Uh(2) 0.5 s; its step (3 s) outlasts B(1) and Uh(1)'s hand-over (2.5 s)
    # by 0.5 s; Uh(1)'s step then runs beside B(0) and U(0) (2.5 s): the end waits 0.5 s more
    assert line.time == 3.0 + 2.5 + 2.5 + 0.5 + 2.5 + 0.5
    spans = [(s.name, s.resource) for s in line.spans if s.resource == HOST_OPTIMIZER]
    assert spans == [("Uh(2)", HOST_OPTIMIZER), ("Uh(1)", HOST_OPTIMIZER)]


def _host_grads(stages) -> KeptBelow:
    return KeptBelow(GRADS, tuple((i, 100) for i in stages), "ram", "gpu", "copy up",
                     "copy down", True)


def test_a_host_stages_gradients_go_down_by_a_store_its_update_waits_for():
    """Inside the backward a host stage's gradients go down by the plan's Store right after
    its Backward, priced on "copy down"; its Update (no hand-over left on compute) waits
    for it. The ops survive the JSON."""
    from dataclasses import replace

    plan = _plan()
    host = replace(STAGE, update_time=0.0, host_update_time=0.5)
    costs = replace(plan.costs, stages=(host,) * 3)
    placed = replace(plan, costs=costs).with_transfers(Transfers(
        host_stages=frozenset({1, 2}), host_gradients=_host_grads({1, 2})))
    shape = [str(op) for op in placed.ops[3:]]
    assert shape == ["B(2)", "store(g2 gpu>ram)", "Uh(2)", "B(1)", "store(g1 gpu>ram)",
                     "Uh(1)", "B(0)", "U(0)"]
    store = placed.ops[4]
    assert (store.what, store.src, store.dst, store.resource, store.nbytes) == (
        GRADS, "gpu", "ram", "copy down", 100)
    line = placed.timeline
    assert line.busy("copy down") == pytest.approx(2 * 100 / 1e6)
    uh2 = next(s for s in line.spans if s.name == "Uh(2)" and s.resource == COMPUTE)
    down2 = next(s for s in line.spans if s.name == "store(g2 gpu>ram)")
    assert uh2.start == pytest.approx(down2.end)
    assert placed.decisions()["transfer_ops"][GRADS] == {"load": 0, "store": 2}
    back = Plan.from_json(placed.to_json())
    assert back.ops == placed.ops and back.transfers == placed.transfers


def test_a_deferred_pass_sends_resident_gradients_down_and_reads_stashed_ones_to_host_ram():
    """Deferred: a resident host stage's gradients go down right before its Uh; a streamed
    one's, stashed on disk, come into host RAM by a Load right before its Uh (from host RAM:
    nothing, they wait there); the compute tier's Update reads its own to the GPU."""
    def passed(home):
        stash = KeptBelow(GRADS, ((1, 100), (2, 100)), home, "gpu",
                          *(("disk read", "disk write") if home == "disk"
                            else ("copy up", "copy down")), True)
        weights = StreamedWeights(((1, 100, 100), (2, 100, 100)), home, "gpu",
                                  stash.read, stash.write, depth=1, written_back=False,
                                  host_updated=frozenset({0, 2}))
        placed = _plan().with_transfers(Transfers(
            weights=weights, update_order=(2, 0, 1), gradients=stash,
            host_stages=frozenset({0, 2}), host_gradients=_host_grads({0})))
        return placed, [op for op in placed.routines.update_pass
                        if getattr(op, "what", None) == GRADS]
    placed, ops = passed("disk")
    assert [str(op) for op in ops] == ["load(g2 disk>ram)", "store(g0 gpu>ram)",
                                       "load(g1 disk>gpu)"]
    assert ops[0].resource == "disk read" and ops[0].nbytes == 100
    names = [str(op) for op in placed.routines.update_pass]
    assert names.index("load(g2 disk>ram)") == names.index("Uh(2)") - 1
    assert names.index("store(g0 gpu>ram)") == names.index("Uh(0)") - 1
    _, ops = passed("ram")
    assert [str(op) for op in ops] == ["store(g0 gpu>ram)", "load(g1 ram>gpu)"]


def test_a_host_step_takes_the_gradients_its_store_sent_down_and_refuses_others():
    """The executor's side: the plan's Store copies a stage's gradients down and frees them
    on the compute tier; the host step takes them (the same values); without the Store it
    refuses the gradients left there rather than copying them itself."""
    import torch
    from torch import nn

    from tierflow.core.errors import TierflowError
    from tierflow.exec.host_update import HostUpdates
    from tierflow.plan.ops import Store

    host = HostUpdates({0}, torch.device("cpu"))
    p = nn.Parameter(torch.arange(4.0))
    twins = host.twins(0, [p])
    opt = torch.optim.SGD(twins, lr=1.0)
    p.grad = torch.ones(4)
    host.send_down(Store(GRADS, 0, "gpu", "ram", "copy down", 16), [p])
    assert p.grad is None and torch.equal(host.sent_down(0)[0], torch.ones(4))
    host.update(0, [p], twins, opt)
    host.wait()
    assert torch.equal(twins[0].detach(), torch.arange(4.0) - 1)
    p.grad = torch.ones(4)
    with pytest.raises(TierflowError, match="copies them down nowhere"):
        host.update(0, [p], twins, opt)
