"""The tier placement planner on small hand-made problems whose optimum is obvious."""
import random
import subprocess
import sys

import pytest

from tierflow.errors import BudgetError
from tierflow.plan.placement import place
from tierflow.plan.placement_problem import (
    ActivationOption,
    Link,
    Placement,
    PlacementError,
    Precision,
    Problem,
    Tier,
)

GB = 10 ** 9
MIXED = Precision(weights=2, grads=2, master=4, moments=8)


def problem(gpu=None, ram=None, disk=None, *, stages=8, params=GB // 4, seconds=1.0,
            link=25 * GB, accum=1, activations=None, host_bw=50 * GB) -> Problem:
    """``stages`` equal stages of ``params`` parameters and ``seconds`` of compute each, on a
    GPU with RAM (and a disk when ``disk`` is not False)."""
    tiers = [Tier("gpu", gpu), Tier("ram", ram)]
    links = [Link(link, link)]
    if disk is not False:
        tiers.append(Tier("disk", disk))
        links.append(Link(5 * GB, 3 * GB))
    acts = activations or (ActivationOption("keep", 2 * GB, stages * seconds),)
    return Problem(params=(params,) * stages, compute=(seconds,) * stages, precision=MIXED,
                   tiers=tuple(tiers), links=tuple(links), activations=acts, grad_accum=accum,
                   host_update_bw=host_bw, device_update_bw=2000 * GB)


def test_everything_fits_the_gpu_nothing_streamed():
    pl = place(problem(gpu=80 * GB, ram=64 * GB))
    assert (pl.weights.resident, pl.grads.resident, pl.optimizer.resident) == (8, 8, 8)
    assert pl.activations == "keep"
    assert pl.peaks["gpu"] == 8 * (GB // 4) * 16 + 2 * GB
    assert pl.peaks["ram"] == 0 and pl.peaks["disk"] == 0
    assert pl.bottleneck.startswith("compute-bound")
    assert pl.step_time == pytest.approx(8.0, rel=0.01)


def test_tiny_gpu_streams_weights_and_the_link_binds():
    # 8 stages of 1e9 parameters: 2 GB of bf16 weights each, 10 ms of compute each; a host
    # optimizer fast enough not to bind
    pl = place(problem(gpu=10 * GB, ram=None, disk=False, params=GB, seconds=0.01,
                       host_bw=10_000 * GB))
    assert pl.weights.resident < 8 and pl.weights.home == "ram"
    assert pl.optimizer.resident == 0 and pl.optimizer.home == "ram"
    assert "ram->gpu link" in pl.bottleneck
    assert pl.peaks["gpu"] <= 10 * GB
    streamed = 8 - pl.weights.resident
    assert pl.times["ram->gpu"] >= streamed * 2 * 2 * GB / (25 * GB)  # forward + backward


def test_every_budget_is_respected_and_tighter_budgets_are_never_faster():
    rng = random.Random(0)
    for _ in range(20):
        gpu, ram = rng.uniform(3, 40) * GB, rng.uniform(4, 60) * GB
        acts = (ActivationOption("keep", int(rng.uniform(1, 6) * GB), 8.0),
                ActivationOption("recompute", GB, 10.0, recomputed=7),
                ActivationOption("offload", GB // 2, 8.0, offload_bytes=5 * GB))
        accum = rng.choice([1, 4])
        try:
            loose = place(problem(int(gpu * 1.5), int(ram * 1.5), activations=acts, accum=accum))
            tight = place(problem(int(gpu), int(ram), activations=acts, accum=accum))
        except PlacementError:
            continue
        for pl in (loose, tight):
            for tier, peak in pl.peaks.items():
                assert pl.budgets[tier] is None or peak <= pl.budgets[tier]
        assert tight.step_time >= loose.step_time - 1e-9


def test_recompute_chosen_only_when_keeping_does_not_fit():
    acts = (ActivationOption("keep", 20 * GB, 8.0), ActivationOption("recompute", 2 * GB, 10.0,
                                                                     recomputed=7))
    roomy = place(problem(gpu=80 * GB, ram=64 * GB, activations=acts))
    assert roomy.activations == "keep"
    tight = place(problem(gpu=36 * GB, ram=None, activations=acts, disk=False))
    assert tight.peaks["gpu"] <= 36 * GB
    assert tight.activations in ("recompute", "keep")
    if tight.activations == "keep":  # then something else moved off the GPU to make room
        assert min(tight.weights.resident, tight.optimizer.resident) < 8


def test_nothing_fits_states_the_smallest_budget_per_tier():
    # 32 GB of weights, gradients and states; 2 GB of activations on the GPU
    with pytest.raises(PlacementError) as info:
        place(problem(gpu=4 * GB, ram=8 * GB, disk=False))
    err = info.value
    assert isinstance(err, BudgetError) and "\n" not in str(err)
    assert "gpu needs at least" in str(err) and "ram needs at least" in str(err)
    smallest = err.smallest_per_tier
    # each smallest budget is enough on its own, with the other tier as given, and no less
    place(problem(gpu=smallest["gpu"], ram=8 * GB, disk=False))
    place(problem(gpu=4 * GB, ram=smallest["ram"], disk=False))
    with pytest.raises(PlacementError):
        place(problem(gpu=smallest["gpu"] - 1, ram=8 * GB, disk=False))
    with pytest.raises(PlacementError):
        place(problem(gpu=4 * GB, ram=smallest["ram"] - 1, disk=False))


def test_a_tier_below_its_floor_is_named():
    with pytest.raises(PlacementError, match=r"no ram budget works with gpu .*whatever ram is, "
                                             r"it takes gpu at least"):
        place(problem(gpu=1 * GB, ram=2 * GB, disk=False))


def test_disk_holds_optimizer_states_when_ram_is_short():
    pl = place(problem(gpu=10 * GB, ram=12 * GB, disk=None))
    assert pl.optimizer.home == "disk"
    assert pl.peaks["disk"] > 0 and pl.peaks["ram"] <= 12 * GB


def test_cpu_machine_ram_is_compute_disk_the_offload_tier():
    p = Problem(params=(GB // 4,) * 4, compute=(1.0,) * 4, precision=MIXED,
                tiers=(Tier("ram", 12 * GB), Tier("disk", None)), links=(Link(2 * GB, GB),),
                activations=(ActivationOption("keep", GB, 4.0),), host_update_bw=10 * GB,
                device_update_bw=10 * GB)
    pl = place(p)
    assert pl.compute_tier == "ram" and pl.peaks["ram"] <= 12 * GB
    assert pl.optimizer.home == "disk" and pl.optimizer.resident < 4
    # on a CPU the optimizer runs on the compute device: it adds to the step
    assert pl.step_time >= 4.0 + pl.times["compute"] - 4.0


def test_json_round_trip():
    pl = place(problem(gpu=10 * GB, ram=None, disk=False, params=GB, seconds=0.01,
                       host_bw=10_000 * GB))
    assert Placement.from_json(pl.to_json()) == pl


def test_placement_module_imports_no_torch():
    code = ("import sys, tierflow.plan.placement, tierflow.sim.predict, tierflow.sim.sweep; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
