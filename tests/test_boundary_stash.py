"""Checkpoints stashed on a lower tier (offload beside recomputation): rotor's tables with
stashable boundaries stay exact and never slower, the simulator checks Stash and Fetch, and
a fitted module whose plan stashes trains exactly as plain PyTorch does."""
import copy
import random
from dataclasses import replace

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import gathered_parameters, train_accumulating, train_side_by_side
from test_rotor import keep_all_peak, random_chain

import tierflow
from tierflow.core.config import FitConfig
from tierflow.plan import Plan
from tierflow.plan.boundary_schedule import BOUNDARY, with_boundary_transfers
from tierflow.plan.boundary_stash import stashable_boundaries, stashed_boundary_costs
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Backward, Fetch, Forward, Load, Stash, Store
from tierflow.plan.rotor import _min_memory, rotor, smallest_budget
from tierflow.plan.simulate import InvalidPlan, check_complete, simulate
from tierflow.plan.strategies import checkpoint_all


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _uniform(length: int = 6) -> ChainCosts:
    """Stages with large boundaries and tapes: a small budget makes rotor recompute."""
    stages = tuple(StageCost(f"s{i}", 1.0, 2.0, 0, 10, 30, input_grad=i > 0)
                   for i in range(length))
    return ChainCosts(stages, input_bytes=10)


STASH_CASES = [(n, seed) for n in range(2, 8) for seed in range(12)]


@pytest.mark.parametrize("length,seed", STASH_CASES)
def test_stashable_boundaries_keep_rotor_exact_and_never_slower(length, seed):
    """With random stashable boundaries: the least-memory schedule's peak is what the table
    says (simulated exactly), every budget's schedule fits and is complete, and none is
    slower than without stashing (stashing only adds options)."""
    rng = random.Random(500 * length + seed)
    costs = random_chain(rng, length, wild=seed % 2 == 1)
    stashing = replace(costs, stashable=tuple(i for i in range(1, length) if rng.random() < 0.7))
    need, _, least_ops = _min_memory(stashing)
    assert simulate(stashing, least_ops).peak == need
    assert smallest_budget(stashing) <= smallest_budget(costs)
    low, high = smallest_budget(costs), keep_all_peak(costs)
    for budget in sorted({low, rng.randint(low, max(low, high)), high}):
        ops = rotor(stashing, budget, slots=None)
        check_complete(stashing, ops)
        sim = simulate(stashing, ops)
        assert sim.peak <= budget
        assert sim.time <= simulate(costs, rotor(costs, budget, slots=None)).time + 1e-9


def test_stashing_replaces_recomputation_at_the_smallest_budget():
    """At the least memory, rotor without stashing recomputes from x[0] again and again; with
    every boundary stashable it forwards each stage twice at most, in the same memory."""
    costs = _uniform()
    stashing = replace(costs, stashable=tuple(range(1, 6)))
    budget = smallest_budget(costs)
    assert smallest_budget(stashing) == budget
    plain = simulate(costs, rotor(costs, budget, slots=None))
    ops = rotor(stashing, budget, slots=None)
    assert [str(op) for op in ops if isinstance(op, (Stash, Fetch))] == \
        [f"stash(x{i})" for i in range(1, 5)] + [f"fetch(x{i})" for i in range(4, 0, -1)]
    assert plain.time == 29.0 and simulate(stashing, ops).time == 23.0
    assert simulate(stashing, ops).peak <= budget


def test_checkpoint_all_stashes_every_stashable_input():
    costs = replace(_uniform(), stashable=(1, 2, 3, 4))
    ops = checkpoint_all(costs)
    stashed = simulate(costs, ops)
    held = simulate(replace(costs, stashable=()), checkpoint_all(replace(costs, stashable=())))
    assert sum(isinstance(op, Stash) for op in ops) == 4
    assert held.peak - stashed.peak == 3 * 10  # x1..x3 no longer wait in memory at B(5)


def test_the_simulator_rejects_what_a_stash_makes_impossible():
    costs = replace(_uniform(3), stashable=(1,))
    with pytest.raises(InvalidPlan, match="on the tier below"):
        simulate(costs, [Forward(0, False), Forward(1, False), Stash(1), Forward(1, True)])
    with pytest.raises(InvalidPlan, match="not a stashable boundary"):
        simulate(costs, [Forward(0, False), Forward(1, False), Stash(2)])
    with pytest.raises(InvalidPlan, match="not on the tier below"):
        simulate(costs, [Forward(0, False), Fetch(1)])


def test_a_stashing_plan_round_trips_through_json():
    costs = replace(_uniform(), stashable=(1, 2, 3, 4))
    plan = Plan("rotor", tuple(rotor(costs, smallest_budget(costs), slots=None)), costs)
    back = Plan.from_json(plan.to_json())
    assert back.ops == plan.ops and back.costs.stashable == (1, 2, 3, 4)
    assert back.predicted_peak == plan.predicted_peak


def test_only_boundaries_whose_io_hides_are_stashable():
    stages = tuple(StageCost(f"s{i}", 0.1, 0.2, 0, 1 << 20, 0, input_grad=i > 0)
                   for i in range(5))
    costs = ChainCosts(stages, input_bytes=1 << 20)
    fast = stashable_boundaries(costs, read_bytes_per_s=1e9, write_bytes_per_s=1e9)
    assert fast == [1, 2, 3]  # never x[0] (the caller's) nor x[L-1] (the last, taped stage)
    assert stashable_boundaries(costs, read_bytes_per_s=1e6, write_bytes_per_s=1e9) == []
    assert stashable_boundaries(costs, read_bytes_per_s=1e9, write_bytes_per_s=1e9,
                                min_bytes=2 << 20) == []
    moved = stashed_boundary_costs(costs, fast, home="disk", read_bytes_per_s=1e9,
                                   write_bytes_per_s=1e9)
    assert moved.static_bytes == 2 << 20  # one write and one read in flight
    assert moved.bandwidths["disk read"] == moved.bandwidths["disk write"] == 1e9


# stage 0 keeps x[1] to recompute stages 1 and 2 from: stashed between
RECOMPUTING = (Forward(0, False), Stash(1), Forward(1, False), Forward(2, True), Backward(2),
               Fetch(1), Forward(1, True), Backward(1), Forward(0, True), Backward(0))


def _stashed(read_ahead: bool = True) -> KeptBelow:
    return KeptBelow(BOUNDARY, ((1, 400),), "disk", "ram", "disk read", "disk write", read_ahead)


def test_a_stashed_checkpoint_is_written_after_its_stash_and_read_one_backward_ahead():
    ops = with_boundary_transfers(RECOMPUTING, _stashed())
    names = [type(op).__name__ for op in ops]
    assert names.index("Store") == names.index("Stash") + 1
    assert ops[names.index("Load") + 1] == Backward(2)  # read while B(2) runs
    on_demand = with_boundary_transfers(RECOMPUTING, _stashed(read_ahead=False))
    names = [type(op).__name__ for op in on_demand]
    assert on_demand[names.index("Load") + 1] == Fetch(1)


def test_a_checkpoint_stashed_again_before_it_is_freed_is_stored_once():
    twice = (Forward(0, False), Stash(1), Forward(1, False), Forward(2, True), Backward(2),
             Fetch(1), Forward(1, False), Stash(1), Fetch(1), Forward(1, True), Backward(1),
             Forward(0, True), Backward(0))
    ops = with_boundary_transfers(twice, _stashed())
    assert sum(isinstance(op, Store) and op.what == BOUNDARY for op in ops) == 1
    assert sum(isinstance(op, Load) and op.what == BOUNDARY for op in ops) == 2


def test_a_slow_tier_makes_the_fetch_wait_for_its_read():
    """Priced on the timeline: the Fetch waits for its Load, which a slow disk makes long."""
    from tierflow.plan.timeline import timeline

    stage = StageCost("s", 1.0, 2.0, 0, 400, 0, input_grad=True)
    base = ChainCosts((stage,) * 3, input_bytes=400)
    compute = timeline(base, RECOMPUTING).time

    def priced(bytes_per_s):
        costs = stashed_boundary_costs(base, [1], home="disk", read_bytes_per_s=bytes_per_s,
                                       write_bytes_per_s=bytes_per_s)
        return timeline(costs, with_boundary_transfers(RECOMPUTING, _stashed())).time

    assert priced(1e9) == pytest.approx(compute)
    assert priced(40.0) > compute + 5.0  # 10 s a read: more than B(2) hides


def _fit_stashing(model, sample, tmp_path, planner, **options):
    """fit() with every boundary stashable on the disk tier; for rotor, the least-memory
    schedule of the profiled costs without their (RSS-measured) transients, as test_fit does."""
    config = FitConfig(planner="keep-all" if planner == "rotor" else planner,
                       stash_boundaries="all", prefetch_depth=1, stream=options.pop("stream"))
    module = tierflow.fit(model, sample, optimizer=_adamw, disk=tmp_path, config=config,
                          **options)
    if planner != "rotor":
        return module
    costs = module.plan.costs
    costs = replace(costs, stages=tuple(replace(s, fwd_transient=0, fwd_transient_nograd=0,
                                                bwd_transient=0, update_transient=0,
                                                param_bytes=0) for s in costs.stages))
    ops = rotor(costs, smallest_budget(costs), slots=None)
    return module.with_plan(Plan("rotor", tuple(ops), costs))


@pytest.mark.parametrize("planner,stream", [("checkpoint-all", "never"), ("rotor", "never"),
                                            ("rotor", "all")])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stashed_checkpoints_train_like_plain_pytorch(tmp_path, family, planner, stream,
                                                      monkeypatch):
    """Three AdamW steps (dropout on) with the checkpoints waiting on the disk tier between
    their first forward and their recomputation: losses and parameters as plain PyTorch's."""
    from tierflow.exec import boundaries

    monkeypatch.setattr(boundaries, "MIN_BYTES", 1)  # tiny boundaries: stash them all
    written = []
    original = boundaries.BoundaryStash._write
    monkeypatch.setattr(boundaries.BoundaryStash, "_write",
                        lambda self, store, key, x: (written.append(store.stage),
                                                     original(self, store, key, x)))
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = _fit_stashing(model, sample, tmp_path, planner, stream=stream)
    assert any(isinstance(op, Stash) for op in module.plan.ops)
    assert module.plan.recomputed_stages()
    train_side_by_side(module, reference, sample, _adamw)
    assert sorted(set(written)) == sorted({op.index for op in module.plan.ops
                                           if isinstance(op, Stash)})
    stores = {op.stage for op in module.plan.ops
              if isinstance(op, Store) and op.what == BOUNDARY}
    assert stores == set(written)  # written where the plan's Stores are, and only there
    assert any(tmp_path.glob("boundary-*.bin"))
    gathered = gathered_parameters(module)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(gathered[name], q, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert module.ledger.peak <= module.plan.simulation.peak


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stashed_checkpoints_with_accumulation(tmp_path, family, monkeypatch):
    """grad_accum=4 with clipping (updates after the last backward): each micro-batch stashes
    its own checkpoints, and training is plain PyTorch's."""
    from tierflow.exec import boundaries

    monkeypatch.setattr(boundaries, "MIN_BYTES", 1)
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(4)]
    module = _fit_stashing(model, samples[0], tmp_path, "checkpoint-all", stream="never",
                           grad_accum=4, max_grad_norm=0.5)
    assert any(isinstance(op, Stash) for op in module.plan.ops)
    train_accumulating(module, reference, samples, _adamw)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], q, atol=1e-4,
                                   rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_a_step_stopped_before_its_backward_leaves_no_stale_checkpoint(tmp_path, monkeypatch):
    """A forward whose loss is dropped (no backward) stashes checkpoints of other inputs:
    the next step writes its own rather than fetching those."""
    from tierflow.exec import boundaries

    monkeypatch.setattr(boundaries, "MIN_BYTES", 1)
    model = tiny_hf("llama", layers=3)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = _fit_stashing(model, sample, tmp_path, "checkpoint-all", stream="never")
    module(**hf_sample(seed=5))  # forward only, then dropped
    train_side_by_side(module, reference, sample, _adamw, steps=1)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], q, atol=1e-4,
                                   rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_a_module_without_a_lower_tier_refuses_a_stashing_plan():
    model = tiny_hf("llama", layers=3)
    module = tierflow.fit(model, hf_sample(), optimizer=_adamw, planner="keep-all")
    costs = replace(module.plan.costs, stashable=(1, 2))
    with pytest.raises(tierflow.TierflowError, match="stashes checkpoints"):
        module.with_plan(Plan("checkpoint-all", tuple(checkpoint_all(costs)), costs))


def test_stashed_checkpoints_under_a_simulated_gpu_wait_in_host_ram(tmp_path, monkeypatch):
    """Three tiers (a simulated GPU over host RAM over disk): the checkpoints wait in the
    host RAM tier, the nearest one below, and training is plain PyTorch's."""
    from tierflow.exec import boundaries
    from tierflow.exec.host_store import HostStore

    monkeypatch.setattr(boundaries, "MIN_BYTES", 1)
    model = tiny_hf("llama", layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", disk=tmp_path,
                          config=FitConfig(simulated_gpu=True, planner="checkpoint-all",
                                           stash_boundaries="all", stream="never"))
    assert module.plan.stashed_boundaries() == [1, 2, 3]
    assert isinstance(module.boundaries.store, HostStore)
    train_side_by_side(module, reference, sample, _adamw)
    assert "checkpoints (x1, x2, x3) between their uses" in module.explain()
    for name, q in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], q, atol=1e-4,
                                   rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
