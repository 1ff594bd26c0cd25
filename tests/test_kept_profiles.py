"""The measurements a training run keeps for `tierflow plan --measure`
(profile/kept_profiles.py): JSON that comes back exactly, one file per run shape, and a file
that is not a record is ignored rather than trusted."""
from __future__ import annotations

import pytest

from tierflow.plan.costs import ChainCosts, SelectiveCost, StageCost
from tierflow.plan.measured import Measured
from tierflow.plan.tier_candidates import UpdateRates
from tierflow.profile.kept_profiles import RunShape, keep_profile, kept_profile

SHAPE = RunShape(model={"family": "llama", "layers": 2, "hidden": 64}, batch=2, seq=128,
                 precision={"model_dtype": "fp32", "matmul_dtype": "fp32"},
                 ram=1 << 30, disk=True)


def _measured() -> Measured:
    stage = StageCost("layers.0", fwd_time=0.1 / 3, bwd_time=0.2, param_bytes=4096,
                      output_bytes=1024, tape=2048, fwd_transient=7, largest_block=512,
                      selective=SelectiveCost(tape=100, recompute_time=0.01, fwd_transient=1,
                                              bwd_transient=2))
    costs = ChainCosts(stages=(stage, StageCost("head", 0.05, 0.07, 8192, 4, 16)),
                       input_bytes=256, static_bytes=1 << 20, extra={"runtime": 12345})
    rates = UpdateRates(state_per_byte=2.0, seconds_per_byte=1.5e-10, transient_per_byte=0.25,
                        transient_bytes=4096)
    return Measured({1024: costs, 256: costs}, rates, disk_rates=(1.2e9, 0.9e9),
                    held=11 << 20)


def test_a_kept_profile_comes_back_as_it_was_measured():
    measured = _measured()
    path = keep_profile(SHAPE, measured)
    kept = kept_profile(SHAPE)
    assert kept is not None and kept.path == path
    assert kept.measured == measured  # every float and byte count, both chunks


@pytest.mark.parametrize("change", [dict(seq=256), dict(batch=4), dict(ram=2 << 30),
                                    dict(disk=False), dict(packed=True), dict(compiled=True),
                                    dict(model={"family": "llama", "layers": 3, "hidden": 64}),
                                    dict(precision={"model_dtype": "bf16",
                                                    "matmul_dtype": "fp32"})])
def test_another_run_shape_finds_nothing_kept(change):
    keep_profile(SHAPE, _measured())
    assert kept_profile(RunShape(**{**SHAPE.__dict__, **change})) is None


def test_a_file_that_is_not_a_record_is_ignored():
    path = keep_profile(SHAPE, _measured())
    for text in ("{not json", "[]", '{"measured": {"costs": {}}}', '{"date": "x"}'):
        path.write_text(text)
        assert kept_profile(SHAPE) is None


def test_forget_profiles_removes_what_runs_kept():
    """What `tierflow calibrate` calls beside ``forget_timings``: the runs' measurements go
    with the timings they were planned on."""
    from tierflow.profile.kept_profiles import forget_profiles

    keep_profile(SHAPE, _measured())
    forget_profiles()
    assert kept_profile(SHAPE) is None
