"""Who does what in a run of ``tierflow train`` (``train/roles.py``): ``--disk DIR`` names a
directory, and each decision a disk tier or a GPU brings is one named rule that the options'
checks, the loop and the help follow."""
from __future__ import annotations

import pytest
import torch

from tierflow.core.errors import TierflowError
from tierflow.train.device import ComputeTier
from tierflow.train.options import TrainOptions
from tierflow.train.roles import builds_on_disk, fit_owns_optimizer, ranks_hold_replicas

MIB = 2 ** 20


def _opts(**values) -> TrainOptions:
    return TrainOptions(model="llama-20m", data="d", **values, given=frozenset(values))


def test_fit_owns_the_optimizer_exactly_when_the_run_has_a_disk_tier_or_a_gpu():
    assert fit_owns_optimizer(_opts(disk="/tmp"))
    assert ranks_hold_replicas(_opts(disk="/tmp"))
    assert fit_owns_optimizer(_opts(gpu="8GiB", ram="16GiB"))  # its states may go below it
    assert not fit_owns_optimizer(_opts()) and not ranks_hold_replicas(_opts())
    resumed = _opts(disk="none").check_flags()  # a run that had a disk tier, resumed without
    assert resumed.disk is None and not fit_owns_optimizer(resumed)


def test_the_options_that_place_fits_optimizer_need_it():
    with pytest.raises(TierflowError, match="tierflow's own AdamW .*give --disk DIR or --gpu"):
        _opts(optimizer_states="disk").check_flags()
    with pytest.raises(TierflowError, match="tierflow's own AdamW .*give --gpu too"):
        _opts(disk="/tmp", host_updates="all").check_flags()
    _opts(disk="/tmp", optimizer_states="disk").check_flags()
    _opts(gpu="8GiB", host_updates="all").check_flags()
    _opts(gpu="8GiB", optimizer_states="ram").check_flags()


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
