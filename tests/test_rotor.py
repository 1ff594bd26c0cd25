"""Rotor is optimal: checked against an exhaustive search that knows nothing of its recursion.

The search (``brute_force``) is Dijkstra over the states of one training step, with its own
incremental memory model of ``simulate()`` (every schedule it returns is re-simulated).
"""
from __future__ import annotations

import functools
import heapq
import itertools
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Backward, Forward, Free, Op, Update
from tierflow.plan.plan import Plan
from tierflow.plan.rotor import Infeasible, rotor, rotor_notes, smallest_budget
from tierflow.plan.simulate import check_complete, simulate
from tierflow.plan.strategies import keep_all

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def random_chain(rng: random.Random, length: int, scale: int = 1, *, wild: bool = False
                 ) -> ChainCosts:
    """A chain with small random integer sizes (times ``scale``) and times. ``wild`` makes
    corner cases likelier: many zero sizes, larger transients, uneven times."""
    def size(low: int, high: int) -> int:
        if wild and rng.random() < 0.4:
            return 0
        units = rng.randint(low, 2 * high if wild else high)
        return units * scale + (rng.randint(0, scale - 1) if scale > 1 else 0)

    def seconds() -> float:
        return rng.choice((0.5, 1, 2, 7)) if wild else rng.randint(1, 5)

    stages = tuple(StageCost(
        name=f"s{i}", fwd_time=seconds(), bwd_time=seconds(),
        param_bytes=size(0, 3), output_bytes=size(1, 4), tape=size(0, 4),
        output_in_tape=rng.random() < 0.4, fwd_transient=size(0, 2),
        fwd_transient_nograd=size(0, 2), bwd_transient=size(0, 2),
        input_grad=i > 0 or rng.random() < 0.5, update_time=rng.randint(0, 1),
        update_transient=size(0, 3)) for i in range(length))
    return ChainCosts(stages, input_bytes=size(1, 4), optimizer_owned=rng.random() < 0.5,
                      shared_grad_bytes=size(0, 3))


def keep_all_peak(costs: ChainCosts) -> int:
    return simulate(costs, keep_all(costs)).peak


def brute_force(costs: ChainCosts, budget: int, *, rotor_class: bool = True
                ) -> tuple[float, list[Op]] | None:
    """The least time of a step whose every op stays within ``budget``, and its ops; None if
    nothing fits.

    State: the plan's references to x (bitmask), the tapes alive (bitmask), the next stage
    to backpropagate ``f`` (stages > f are done: grad[f+1] and their parameter gradients
    exist), and which held x have already been forwarded from. Moves: Forward(i, tape) for
    i <= f from a held x[i]; Forward(i) without tape for i < f when x[i+1] is not held
    (anything else is useless); Backward(f), followed at once by Update(f) when tierflow owns
    the optimizer (the rule rotor follows: the search does not move updates around).

    ``rotor_class=True`` keeps to the schedules rotor optimises over. (1) Persistence: a
    value is dropped either right after it is made (Forward(i, tape) then Free(i+1): the
    backward needs grad[i+1], not x[i+1]) or right after its first use (Forward(k) then
    Free(k): a transit value); otherwise it stays until its backward. (2) A taped forward
    makes its output: Forward(i, tape) never runs while x[i+1] is resident.
    ``rotor_class=False`` lifts both (Free(k) of any held k > 0 at any time, taped forwards
    whenever). Each lift admits strictly better schedules, which the paper's dynamic
    program does not consider: see the two ``test_unrestricted_search_*`` tests.
    """
    length, stages = costs.length, costs.stages
    owned, shared = costs.optimizer_owned, costs.shared_grad_bytes

    def held(i: int, refs: int, tapes: int) -> bool:
        return bool(refs >> i & 1 or tapes >> i & 1
                    or (i > 0 and tapes >> (i - 1) & 1))

    @functools.cache
    def resident(refs: int, tapes: int, f: int) -> int:
        total = sum(costs.x_bytes(i) for i in range(length + 1) if held(i, refs, tapes))
        total += sum(stages[i].tape for i in range(length) if tapes >> i & 1)
        if f + 1 < length and stages[f + 1].input_grad:
            total += costs.x_bytes(f + 1)  # grad[f+1], or grad[0] when f == -1
        if not owned:
            total += sum(stages[i].param_bytes for i in range(f + 1, length))
        if f < length - 1 and not (owned and f == -1):
            total += shared  # from Backward(L-1) to Update(0)
        return total

    def moves(state):
        refs, tapes, f, used = state
        now = resident(refs, tapes, f)
        for i in range(f + 1):
            if not (refs >> i & 1 or tapes >> i & 1):
                continue
            out_held = refs >> (i + 1) & 1
            new_out = 0 if held(i + 1, refs, tapes) else costs.x_bytes(i + 1)
            used_after = (used | 1 << i) & ~(0 if out_held else 1 << (i + 1))
            out_refs = refs | 1 << (i + 1)
            s = stages[i]
            if not tapes >> i & 1 and not (rotor_class and held(i + 1, refs, tapes)):
                peak, taped = now + new_out + s.tape + s.fwd_transient, tapes | 1 << i
                yield (Forward(i, True),), (out_refs, taped, f, used_after), peak, s.fwd_time
                if rotor_class:  # x[i+1] was not resident, so the plan may drop it at once
                    yield ((Forward(i, True), Free(i + 1)), (refs, taped, f, used_after),
                           peak, s.fwd_time)
            if i < f and not out_held:
                peak = now + new_out + s.fwd_transient_nograd
                yield (Forward(i, False),), (out_refs, tapes, f, used_after), peak, s.fwd_time
                if rotor_class and i > 0 and refs >> i & 1 and not used >> i & 1:
                    transit = out_refs & ~(1 << i)
                    yield ((Forward(i, False), Free(i)), (transit, tapes, f, used_after & transit),
                           peak, s.fwd_time)
        if not rotor_class:
            for k in range(1, length + 1):
                if refs >> k & 1:
                    yield (Free(k),), (refs & ~(1 << k), tapes, f, used & ~(1 << k)), now, 0.0
        if f >= 0 and tapes >> f & 1:
            yield backward(state, now)

    def backward(state, now):
        refs, tapes, f, used = state
        s = stages[f]
        after = refs & ~(1 << (f + 1)) & ~(1 << f if f > 0 else 0)
        nxt = (after, tapes & ~(1 << f), f - 1, used & after)
        made = (costs.x_bytes(f) if s.input_grad else 0) + s.param_bytes
        peak = now + made + (shared if f == length - 1 else 0) + s.bwd_transient
        if not owned:
            return (Backward(f),), nxt, peak, s.bwd_time
        before_update = (resident(*nxt[:3]) + s.param_bytes + (shared if f == 0 else 0))
        peak = max(peak, before_update + s.update_transient)
        return (Backward(f), Update(f)), nxt, peak, s.bwd_time + s.update_time

    start = (1, 0, length - 1, 0)
    best = {start: 0.0}
    came_from: dict = {}
    heap = [(0.0, 0, start)]
    tie = itertools.count(1)
    while heap:
        spent, _, state = heapq.heappop(heap)
        if spent > best[state]:
            continue
        if state[2] == -1:
            ops: list[Op] = []
            while state != start:
                state, step = came_from[state]
                ops[:0] = step
            return spent, ops
        for step, nxt, peak, seconds in moves(state):
            if max(peak, resident(*nxt[:3])) > budget:
                continue
            if spent + seconds < best.get(nxt, float("inf")) - 1e-12:
                best[nxt] = spent + seconds
                came_from[nxt] = (state, step)
                heapq.heappush(heap, (spent + seconds, next(tie), nxt))
    return None


def checked_search(costs: ChainCosts, budget: int, **kw) -> tuple[float, list[Op]] | None:
    """brute_force, with its schedule re-simulated: the search's memory model is simulate's."""
    found = brute_force(costs, budget, **kw)
    if found is not None:
        sim = simulate(costs, found[1])
        check_complete(costs, found[1])
        assert sim.peak <= budget and sim.time == pytest.approx(found[0], abs=1e-9)
    return found


# (length, count) of random cases per test run: small chains are many, long ones few.
CASES = [(n, seed) for n, count in ((1, 10), (2, 15), (3, 20), (4, 20), (5, 20), (6, 12),
                                    (7, 4), (8, 2)) for seed in range(count)]


@pytest.mark.parametrize("length,seed", CASES)
def test_rotor_matches_exhaustive_search(length: int, seed: int) -> None:
    rng = random.Random(1000 * length + seed)
    costs = random_chain(rng, length, wild=seed % 2 == 1)
    smallest = smallest_budget(costs)
    budget = rng.randint(smallest, keep_all_peak(costs))
    ops = rotor(costs, budget, slots=None)
    check_complete(costs, ops)
    sim = simulate(costs, ops)
    optimum = checked_search(costs, budget)
    assert optimum is not None
    assert sim.peak <= budget
    assert sim.time == pytest.approx(optimum[0], abs=1e-9), (
        " ".join(map(str, ops)), " ".join(map(str, optimum[1])))


@pytest.mark.parametrize("length,seed", [c for c in CASES if c[0] <= 5])
def test_smallest_budget_is_the_least_that_fits(length: int, seed: int) -> None:
    costs = random_chain(random.Random(7000 + 1000 * length + seed), length, wild=seed % 2 == 1)
    smallest = smallest_budget(costs)
    assert checked_search(costs, smallest) is not None
    assert checked_search(costs, smallest - 1) is None
    assert simulate(costs, rotor(costs, smallest, slots=None)).peak <= smallest
    assert simulate(costs, rotor(costs, smallest)).peak <= smallest


def _stage(i: int, fwd: float, bwd: float, params: int, out: int, tape: int, in_tape: bool,
           tr: int, tr_nograd: int, tr_bwd: int, upd: float, tr_upd: int) -> StageCost:
    return StageCost(f"s{i}", fwd, bwd, params, out, tape, in_tape, tr, tr_nograd, tr_bwd,
                     input_grad=i > 0, update_time=upd, update_transient=tr_upd)


def test_unrestricted_search_is_faster_without_persistence() -> None:
    """Why the search keeps to persistent schedules: with x0, x1 and x3 kept after the first
    sweep, the fastest step drops x1 after recomputing x2 from it, and later recomputes x1
    from x0 (56 s). A persistent schedule keeps a used x1 until its backward, or never
    keeps it: 59 s at best, which rotor finds."""
    costs = ChainCosts((_stage(0, 3, 5, 3, 1, 0, True, 0, 1, 2, 1, 2),
                        _stage(1, 3, 5, 0, 2, 4, False, 2, 1, 2, 1, 1),
                        _stage(2, 5, 3, 3, 3, 2, True, 0, 2, 0, 1, 0),
                        _stage(3, 4, 3, 2, 1, 2, True, 0, 0, 2, 1, 0),
                        _stage(4, 4, 3, 0, 3, 0, False, 2, 0, 1, 0, 3)),
                       input_bytes=3, optimizer_owned=True)
    general = checked_search(costs, 18, rotor_class=False)
    assert general is not None and general[0] == 56
    assert checked_search(costs, 18)[0] == 59
    assert simulate(costs, rotor(costs, 18, slots=None)).time == 59


def test_infeasible_budget_names_the_smallest() -> None:
    costs = random_chain(random.Random(3), 6, scale=MiB)
    smallest = smallest_budget(costs)
    with pytest.raises(Infeasible) as caught:
        rotor(costs, smallest - 1)
    assert caught.value.smallest == smallest
    assert "MiB" in str(caught.value) and "raise the budget" in str(caught.value)
    assert simulate(costs, rotor(costs, smallest)).peak <= smallest


def test_keep_all_budget_recomputes_nothing() -> None:
    for seed in range(20):
        costs = random_chain(random.Random(seed), 1 + seed % 8, scale=1 + 1000 * (seed % 2))
        ops = rotor(costs, keep_all_peak(costs))
        assert simulate(costs, ops).time == simulate(costs, keep_all(costs)).time
        assert "nothing is recomputed" in rotor_notes(costs, ops)[0]


@pytest.mark.parametrize("slots", [None, 7, 500])
def test_more_budget_never_costs_time(slots: int | None) -> None:
    for seed in range(10):
        costs = random_chain(random.Random(100 + seed), 6)
        times = []
        for budget in range(smallest_budget(costs), keep_all_peak(costs) + 1):
            sim = simulate(costs, rotor(costs, budget, slots=slots))
            assert sim.peak <= budget
            times.append(sim.time)
        if slots is None:
            assert times == sorted(times, reverse=True)


def test_slots_always_fit_and_approach_the_exact_optimum() -> None:
    for seed in range(12):
        rng = random.Random(200 + seed)
        costs = random_chain(rng, 5, scale=10)
        budget = rng.randint(smallest_budget(costs), keep_all_peak(costs))
        exact = simulate(costs, rotor(costs, budget, slots=None)).time
        for slots in (5, 20, 100):
            sim = simulate(costs, rotor(costs, budget, slots=slots))
            assert sim.peak <= budget and sim.time >= exact - 1e-9
        assert simulate(costs, rotor(costs, budget, slots=budget)).time == exact


def transformer_like(length: int) -> ChainCosts:
    rng = random.Random(length)
    stages = tuple(StageCost(
        f"layers.{i}", fwd_time=0.01 * (1 + rng.random()), bwd_time=0.02 * (1 + rng.random()),
        param_bytes=50 * MiB, output_bytes=64 * MiB, tape=rng.randint(200, 400) * MiB,
        output_in_tape=rng.random() < 0.3, fwd_transient=64 * MiB,
        fwd_transient_nograd=32 * MiB, bwd_transient=128 * MiB, update_time=0.001,
        update_transient=10 * MiB) for i in range(length))
    return ChainCosts(stages, input_bytes=64 * MiB, optimizer_owned=length % 2 == 0,
                      shared_grad_bytes=100 * MiB)


@pytest.mark.exclusive  # timed
def test_32_stages_solve_fast_and_fit() -> None:
    costs = transformer_like(32)
    smallest, top = smallest_budget(costs), keep_all_peak(costs)
    for fraction in (0.05, 0.5, 0.95):
        budget = int(smallest + fraction * (top - smallest))
        started = time.perf_counter()
        ops = rotor(costs, budget, slots=500)
        assert time.perf_counter() - started < 2.0
        plan = Plan("rotor", tuple(ops), costs, budget=budget, notes=tuple(rotor_notes(costs, ops)))
        assert plan.simulation.peak <= budget
        assert plan.recomputed_stages()
        assert keep_all_peak(costs) > plan.simulation.peak


def test_rejects_a_chain_no_plan_can_backpropagate() -> None:
    costs = random_chain(random.Random(5), 3)
    stages = list(costs.stages)
    stages[1] = replace(stages[1], input_grad=False)
    with pytest.raises(ValueError, match="input_grad=False"):
        rotor(ChainCosts(tuple(stages), input_bytes=costs.input_bytes), 10**6)


def test_planner_imports_no_torch() -> None:
    code = ("import sys; sys.path.insert(0, 'src'); import tierflow.plan.rotor; "
            "assert 'torch' not in sys.modules, 'tierflow.plan.rotor imported torch'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_context_bytes_are_part_of_every_budget() -> None:
    """The step's context (masks, rotary tables) is resident throughout: the smallest budget
    grows by exactly its size, and every plan made for a budget still fits it."""
    costs = random_chain(random.Random(11), 6, scale=MiB)
    with_context = replace(costs, context_bytes=3 * MiB)
    assert smallest_budget(with_context) == smallest_budget(costs) + 3 * MiB
    for budget in (smallest_budget(with_context), smallest_budget(with_context) + 5 * MiB):
        assert simulate(with_context, rotor(with_context, budget)).peak <= budget


@pytest.mark.parametrize("seed", range(4))
def test_resident_gradients_add_nothing_during_the_step(seed: int) -> None:
    """With gradients accumulated over micro-batches (``grads_resident``, no owned
    optimizer), a backward makes no new gradient bytes: the simulator and rotor see the chain
    as one whose stages own no gradients, and every plan fits its budget."""
    costs = replace(random_chain(random.Random(seed), 7), optimizer_owned=False)
    resident = replace(costs, grads_resident=True)
    bare = replace(costs, shared_grad_bytes=0,
                   stages=tuple(replace(s, param_bytes=0) for s in costs.stages))
    assert keep_all_peak(resident) == keep_all_peak(bare) < keep_all_peak(costs)
    assert smallest_budget(resident) == smallest_budget(bare)
    for budget in (smallest_budget(resident), keep_all_peak(resident)):
        ops = rotor(resident, budget, slots=None)
        assert ops == rotor(bare, budget, slots=None)
        assert simulate(resident, ops).peak <= budget
    assert ChainCosts.from_dict(resident.to_dict()) == resident


class _Recording:
    """A stage whose reads are recorded: which of its fields a computation depends on."""

    def __init__(self, stage: StageCost, read: set[str]):
        self._stage, self._read = stage, read

    def __getattr__(self, name: str):
        self._read.add(name)
        return getattr(self._stage, name)


@pytest.mark.parametrize("seed", range(6))
def test_rotor_remembers_under_a_key_of_everything_its_tables_read(seed: int) -> None:
    """rotor remembers its schedules per ``needs_key``: the tables and ``simulate()`` must
    read no stage field outside it, and costs differing only outside it (static bytes, host
    update times) get the schedule computed afresh for them."""
    from tierflow.plan.rotor import _rotor
    from tierflow.plan.rotor_model import NEEDS_FIELDS, SegmentNeeds, needs_key
    rng = random.Random(seed)
    costs = random_chain(rng, rng.randint(2, 7), wild=True)
    costs = replace(costs, stashable=(1,))
    read: set[str] = set()
    recorded = replace(costs, stages=tuple(_Recording(s, read) for s in costs.stages))
    budget = (smallest_budget(costs) + keep_all_peak(costs)) // 2
    SegmentNeeds(recorded, unit=1)
    simulate(recorded, _rotor(recorded, budget, slots=None))
    assert read <= set(NEEDS_FIELDS)
    other = replace(costs, static_bytes=costs.static_bytes + 12345, stages=tuple(
        replace(s, host_update_time=s.host_update_time + 1.0) for s in costs.stages))
    assert needs_key(other) == needs_key(costs)
    assert rotor(other, budget, slots=None) == _rotor(costs, budget, slots=None)
    changed = replace(costs, stages=(replace(costs.stages[0], tape=costs.stages[0].tape + 1),
                                     *costs.stages[1:]))
    assert needs_key(changed) != needs_key(costs)
