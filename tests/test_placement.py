"""`tierflow plan` on GPU profiles: the trainer's own placement search (plan/tier_search.py)
on analytic costs, reported as a Placement, on cases whose answer is plain."""
import subprocess
import sys

import pytest

from tierflow.core.errors import BudgetError
from tierflow.plan.placement import Placement, PlacementError
from tierflow.sim.calibrate import hardware
from tierflow.sim.hardware import Hardware
from tierflow.sim.predict import predict
from tierflow.sim.setup import Setup
from tierflow.sim.shapes import load_shape

GIB = 2 ** 30
H100 = hardware("h100-sxm")


def setup(model="llama-134m", gpu=None, ram=None, disk=False, seq=1024, **more) -> Setup:
    return Setup(shape=load_shape(model), hardware=H100, seq=seq, batch=1, gpu=gpu, ram=ram,
                 disk=disk, **more)


def test_everything_fits_the_gpu_nothing_streamed():
    pl = predict(setup(gpu=80 * GIB, ram=64 * GIB)).placement
    assert (pl.weights.resident, pl.grads.resident, pl.optimizer.resident) == (pl.stages,) * 3
    assert pl.activations == "keep"
    assert pl.peaks["ram"] == 0 and pl.peaks["gpu"] <= 80 * GIB
    assert pl.bottleneck.startswith("compute-bound")
    assert set(pl.times) == {"compute", "update pass"}  # clipped (tierflow train's default)
    unclipped = predict(setup(gpu=80 * GIB, ram=64 * GIB, clips=False)).placement
    assert set(unclipped.times) == {"compute"}  # the updates inside the backward


def test_a_small_gpu_streams_weights_from_host_ram_over_the_link():
    """llama-134m (0.27 GB of bf16 weights, 2 GB of training state) under 512 MiB of GPU:
    weights and states live in host RAM, the weights cross the link up; the states that
    stay on the GPU are those of stages kept whole there."""
    pl = predict(setup(gpu=GIB // 2, ram=16 * GIB)).placement
    assert pl.weights.home == "ram" and pl.weights.resident < pl.stages
    assert pl.optimizer.home == "ram" and pl.optimizer.resident <= pl.weights.resident
    assert pl.optimizer.resident < pl.stages // 2
    assert pl.peaks["gpu"] <= GIB // 2 and 0 < pl.peaks["ram"] <= 16 * GIB
    assert pl.times["copy up"] > 0


@pytest.mark.parametrize("gpu, ram", [(0.5, 4), (1, 8), (2, 16)])
def test_budgets_are_respected_and_tighter_ones_are_never_faster(gpu, ram):
    loose = predict(setup(gpu=int(1.5 * gpu * GIB), ram=int(1.5 * ram * GIB)))
    tight = predict(setup(gpu=int(gpu * GIB), ram=int(ram * GIB)))
    for pl in (loose.placement, tight.placement):
        for tier, peak in pl.peaks.items():
            assert pl.budgets[tier] is None or peak <= pl.budgets[tier]
    assert tight.step_time >= loose.step_time * (1 - 1e-9)


def test_recompute_is_chosen_only_when_keeping_does_not_fit():
    roomy = predict(setup(gpu=80 * GIB, ram=64 * GIB, seq=4096)).placement
    assert roomy.activations == "keep" and roomy.recomputed == 0
    tight = predict(setup(gpu=GIB, ram=64 * GIB, seq=4096)).placement
    assert tight.peaks["gpu"] <= GIB
    assert tight.recomputed > 0 or tight.activations != "keep"


def test_nothing_fits_states_the_smallest_budget_per_tier():
    with pytest.raises(PlacementError) as info:
        predict(setup(gpu=GIB // 2, ram=GIB))
    err = info.value
    assert isinstance(err, BudgetError) and "\n" not in str(err)
    assert "gpu needs at least" in str(err) and "ram needs at least" in str(err)
    smallest = err.smallest_per_tier
    # each smallest budget is enough with the other tier as given, and a little less is not
    predict(setup(gpu=GIB // 2, ram=smallest["ram"]))
    predict(setup(gpu=smallest["gpu"], ram=GIB))
    with pytest.raises(BudgetError):
        predict(setup(gpu=GIB // 2, ram=smallest["ram"] - (8 << 20)), smallest_budgets=False)
    with pytest.raises(BudgetError):
        predict(setup(gpu=smallest["gpu"] - (8 << 20), ram=GIB), smallest_budgets=False)


def test_a_tier_below_its_floor_is_named():
    with pytest.raises(PlacementError, match=r"no ram budget works with gpu .*whatever ram is, "
                                             r"it takes gpu at least"):
        predict(setup(gpu=GIB // 16, ram=16 * GIB))


def test_the_disk_holds_what_host_ram_cannot():
    """llama-134m's optimizer states (1.5 GiB) fit neither 512 MiB of GPU nor 3 GiB of host
    RAM (of which the CUDA runtime and the page-locked heap may take 1.4 GiB): they live on
    the disk below them."""
    pl = predict(setup(gpu=GIB // 2, ram=3 * GIB, disk=True)).placement
    assert pl.optimizer.home == "disk"
    assert pl.peaks["disk"] > 0 and pl.peaks["ram"] <= 3 * GIB


def test_a_cpu_machine_computes_in_ram_over_the_disk():
    cpu = Hardware(name="cpu", about="test", gpu_bytes=None,
                   peak_flops={"fp32": 1e11, "bf16": 4e11}, memory_bw=10e9, host_link_bw=None,
                   host_memory_bw=10e9, disk_read_bw=2e9, disk_write_bw=1e9,
                   matmul_efficiency=0.8, memory_efficiency=0.4, attention_efficiency=0.2)
    ram = int(1.25 * GIB)  # clipped: every gradient waits for the update pass
    pl = predict(Setup(load_shape("llama-134m"), cpu, seq=512, batch=2, ram=ram,
                       disk=True)).placement
    assert pl.compute_tier == "ram" and set(pl.peaks) == {"ram", "disk"}
    assert pl.peaks["ram"] <= ram and pl.optimizer.home == "disk"


def test_json_round_trip():
    pl = predict(setup(gpu=GIB // 2, ram=16 * GIB)).placement
    assert Placement.from_json(pl.to_json()) == pl


def test_the_planner_and_the_simulator_import_no_torch():
    code = ("import sys, tierflow.plan.placement, tierflow.plan.tier_search, "
            "tierflow.sim.predict, tierflow.sim.sweep; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
