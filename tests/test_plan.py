"""The planner as pure data: simulation rules, JSON round trips, explanations, configs."""
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow import BudgetError, FitConfig
from tierflow.plan import (
    Backward,
    ChainCosts,
    Forward,
    Free,
    InvalidPlan,
    Plan,
    StageCost,
    simulate,
)
from tierflow.plan.choose import make_plan
from tierflow.plan.strategies import checkpoint_all, keep_all

SRC = Path(__file__).resolve().parents[1] / "src"


def chain_costs(n: int = 4, *, owned: bool = False, static: int = 1000) -> ChainCosts:
    stages = tuple(StageCost(f"s{i}", fwd_time=1.0 + i, bwd_time=2.0, param_bytes=10,
                             output_bytes=100, tape=300, fwd_transient=5, bwd_transient=7)
                   for i in range(n))
    return ChainCosts(stages, input_bytes=100, static_bytes=static, optimizer_owned=owned)


def test_planner_imports_no_torch():
    code = ("import sys; sys.path.insert(0, %r); import tierflow.plan, tierflow.plan.choose, "
            "tierflow.core.config; assert 'torch' not in sys.modules, 'torch was imported'" % str(SRC))
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keep_all_and_checkpoint_all_costs():
    c = chain_costs()
    keep = simulate(c, keep_all(c))
    ckpt = simulate(c, checkpoint_all(c))
    assert keep.time == pytest.approx(sum(1.0 + i for i in range(4)) + 4 * 2.0)
    assert ckpt.time == pytest.approx(keep.time + sum(1.0 + i for i in range(3)))
    # keep-all holds every tape at the turn: x0..x4 and four tapes, plus the last forward's transient
    assert keep.peak == 5 * 100 + 4 * 300 + 10 + 7 + 100  # + param grads of stage 3, grad x3, transient
    assert ckpt.peak < keep.peak


def test_growth_is_what_each_op_adds_at_its_peak():
    c = chain_costs(3)
    sim = simulate(c, keep_all(c))
    growth = sim.growth()
    assert len(growth) == len(sim.timeline)
    # the first forward: its output, tape and transient over x0 (counted from nothing)
    assert growth[0] == sim.timeline[0].peak
    # every later op: its peak over what the op before it left
    for k in range(1, len(growth)):
        assert growth[k] == max(0, sim.timeline[k].peak - sim.timeline[k - 1].resident)
    assert growth[1] == 100 + 300 + 5  # Forward(1): output, tape, transient
    assert max(growth) <= sim.peak


def test_simulator_rejects_invalid_plans():
    c = chain_costs(2)
    with pytest.raises(InvalidPlan, match="tape"):
        simulate(c, [Forward(0, False), Forward(1, True), Backward(1), Backward(0)])
    with pytest.raises(InvalidPlan, match="x\\[1\\] is not held"):
        simulate(c, [Forward(0, False), Free(1), Forward(1, True)])
    with pytest.raises(InvalidPlan, match="backward order"):
        Plan("bad", (Forward(0, True), Forward(1, True), Backward(1)), c)


def test_plan_json_round_trip_and_explain():
    c = chain_costs(5, owned=True)
    plan = make_plan(c, 1000 + simulate(c, checkpoint_all(c)).peak + 50, FitConfig())
    assert plan.strategy == "rotor"
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.predicted_peak == plan.predicted_peak
    text = plan.explain()
    assert "recomputed during backward" in text and "predicted peak" in text
    assert "updated as soon as its gradients are complete" in text


def test_auto_keeps_everything_when_it_fits():
    c = chain_costs()
    plan = make_plan(c, 10**9, FitConfig())
    assert plan.strategy == "keep-all" and plan.recomputed_stages() == []


def test_infeasible_budget_names_the_smallest():
    c = chain_costs()
    with pytest.raises(BudgetError) as err:
        make_plan(c, 1200, FitConfig(), tier="ram")
    message = str(err.value)
    assert "\n" not in message and "ram budget" in message and "at least" in message
    assert isinstance(err.value, ValueError)
    make_plan(c, err.value.smallest, FitConfig())  # the stated smallest works
    with pytest.raises(BudgetError):
        make_plan(c, err.value.smallest - 2, FitConfig())


def test_fit_config_round_trip(tmp_path):
    config = FitConfig.generate("rotor")
    path = tmp_path / "fit.json"
    config.save(path)
    assert FitConfig.load(path) == config
    with pytest.raises(ValueError, match="unknown"):
        FitConfig(planner="magic")
    with pytest.raises(ValueError, match="stash_boundaries 'some' is unknown"):
        FitConfig(stash_boundaries="some")
