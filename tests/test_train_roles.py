"""Who does what in a run of ``tierflow train`` (``train/roles.py``): ``--disk DIR`` names a
directory, and each decision a disk tier brings is one named rule that the options' checks,
the loop and the help follow; and the records the run is handed down as (``train/run.py``)."""
from __future__ import annotations

import pytest
import torch

from tierflow.errors import TierflowError
from tierflow.train.device import ComputeTier
from tierflow.train.logger import StepLine
from tierflow.train.options import TrainOptions
from tierflow.train.roles import builds_on_disk, fit_owns_optimizer, ranks_hold_replicas
from tierflow.train.run import DEFAULT_STEPS, Schedule

MIB = 2 ** 20


def _opts(**values) -> TrainOptions:
    return TrainOptions(model="llama-20m", data="d", **values, given=frozenset(values))


def test_fit_owns_the_optimizer_exactly_when_the_run_has_a_disk_tier():
    assert fit_owns_optimizer(_opts(disk="/tmp"))
    assert ranks_hold_replicas(_opts(disk="/tmp"))
    for opts in (_opts(), _opts(gpu="8GiB", ram="16GiB")):  # a GPU alone changes nothing yet
        assert not fit_owns_optimizer(opts)
        assert not ranks_hold_replicas(opts)
    resumed = _opts(disk="none").check_flags()  # a run that had a disk tier, resumed without
    assert resumed.disk is None and not fit_owns_optimizer(resumed)


def test_the_options_that_place_fits_optimizer_need_it():
    with pytest.raises(TierflowError, match="tierflow's own AdamW .*give --disk DIR too"):
        _opts(optimizer_states="disk").check_flags()
    with pytest.raises(TierflowError, match="tierflow's own AdamW .*give --gpu and --disk"):
        _opts(gpu="8GiB", host_updates="all").check_flags()
    _opts(disk="/tmp", optimizer_states="disk").check_flags()
    _opts(disk="/tmp", gpu="8GiB", host_updates="all").check_flags()


def test_shards_refuse_a_random_stream_and_replicas_take_it():
    rounding = {"model_dtype": "bf16", "master": "none", "matmul_dtype": "bf16"}
    with pytest.raises(TierflowError, match="cannot run on 2 ranks: ZeRO sharding"):
        _opts(**rounding).check_flags(world_size=2)
    with pytest.raises(TierflowError, match="cannot run on 2 ranks"):
        _opts(**rounding, disk="none").check_flags(world_size=2)
    _opts(**rounding, disk="/tmp").check_flags(world_size=2)
    _opts(**rounding).check_flags(world_size=1)


def test_a_model_is_built_on_the_disk_tier_on_the_cpu_or_when_its_weights_pass_the_ram():
    cpu = ComputeTier(torch.device("cpu"), False, None, 64 * MIB)
    assert builds_on_disk(cpu, 1)
    assert builds_on_disk(ComputeTier(torch.device("cpu"), False, None, None), 1)
    gpu = ComputeTier(torch.device("cpu"), True, 32 * MIB, 64 * MIB)
    assert not builds_on_disk(gpu, 64 * MIB)
    assert builds_on_disk(gpu, 64 * MIB + 1)
    assert not builds_on_disk(ComputeTier(torch.device("cpu"), True, 32 * MIB, None), 1 << 40)


def test_the_schedule_of_the_options():
    assert Schedule.of(_opts(steps=40), 10_000) == Schedule(40, 2, 3e-4 / 10, 1024)
    assert Schedule.of(_opts(), 10_000).total == DEFAULT_STEPS
    # 2.5 passes over 10,000 tokens at 4 x 2 x 256 tokens a step: 12.2, rounded up
    epochs = Schedule.of(_opts(epochs=2.5, grad_accum=2, warmup=0, min_lr=1e-5), 10_000)
    assert epochs == Schedule(13, 0, 1e-5, 2048)
    assert epochs.lr(1, 3e-4) == pytest.approx(3e-4)  # no warmup: the peak first
    assert epochs.lr(13, 3e-4) == pytest.approx(1e-5)  # the cosine ends at min_lr


def test_the_step_line():
    line = StepLine(step=12, total=384, ms=1869.2, norm=4.314, loss=3.2821, tok_s=35_100,
                    sol=0.429, ram_bytes=3 * 2 ** 30, budget=4 * 2 ** 30)
    assert line.text() == ("[T] step 12 [ 3.1%] | 1869 ms | norm 4.31 | loss 3.282 | "
                           "35.1k tok/s | sol 42.9% | ram 3.0/4.0 GiB")
    gpu = StepLine(step=1, total=1, ms=1.0, norm=1.0, loss=1.0, tok_s=1.0, sol=None,
                   ram_bytes=None, budget=None, gpu_bytes=2 ** 30, gpu_budget=2 * 2 ** 30)
    assert gpu.text().endswith("| sol - | ram -/- GiB | gpu 1.0/2.0 GiB")
