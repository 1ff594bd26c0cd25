"""tierflow train --gpu: without CUDA it is one line pointing at --ram and --simulate-gpu; a
simulated GPU (the CPU planned as a GPU of --gpu bytes, host RAM and --disk below) trains
with the losses of the plain CPU run; a GPU out-of-memory error re-plans and reruns the step
once (injected: a CPU never raises one)."""
from __future__ import annotations

import os

import pytest
import torch
from cli_support import assert_error_line, fp32_train_args, records, run_main, train_losses

STEPS = 3


def train_args(env, out, *extra):
    return fp32_train_args(env, out, STEPS, *extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_gpu_without_cuda_is_one_line(train_env, tmp_path, capsys):
    code, _, err = run_main(*train_args(train_env, tmp_path / "a", "--gpu", "8GiB"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--gpu 8GiB", "CUDA", "--ram", "--simulate-gpu"])
    code, _, err = run_main(*train_args(train_env, tmp_path / "b", "--simulate-gpu"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--simulate-gpu needs --gpu"])
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


@pytest.mark.parametrize("chosen", [None, "expandable_segments:False"])
def test_a_cuda_gpu_gets_growable_allocator_segments_unless_chosen(monkeypatch, chosen):
    """--gpu on CUDA sets PYTORCH_CUDA_ALLOC_CONF to expandable segments before CUDA first
    allocates (so that the allocator reserves about what the budget counts), and leaves a
    setting the user made alone. (CUDA's presence is faked: this machine has none.)"""
    from tierflow.train.device import ALLOCATOR_SETTINGS, ComputeTier
    from tierflow.train.options import TrainOptions

    if chosen is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", chosen)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tier = ComputeTier.from_options(TrainOptions(gpu="8GiB", ram="16GiB"))
    assert tier.device == torch.device("cuda", 0) and not tier.simulated
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (chosen or ALLOCATOR_SETTINGS)


def test_a_gpu_budget_too_small_names_the_smallest_that_works(train_env, tmp_path, capsys):
    """Under --gpu without --disk, fit owns the optimizer and may keep its states and the
    weights in the host RAM below: a GPU budget below even the smallest such plan names the
    smallest GPU budget that works, in one line with exit 2. (The test model streams in
    about 1 MiB once this process has paid the runtime's first-use bytes: 64 KiB holds not
    even its largest stage's weights.)"""
    code, _, err = run_main(*train_args(train_env, tmp_path / "a", "--gpu", "64KiB",
                                        "--simulate-gpu", "--ram", "1GiB"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--gpu 64.00 KiB is below the smallest", "give --gpu"])


def test_a_model_whose_weights_pass_a_cuda_gpu_budget_is_one_line():
    """Without --disk the model goes to the GPU whole: weights above --gpu are one line naming
    both sizes and --disk, before anything is moved. (The CUDA tier is made by hand: this
    machine has none, and the check runs before any CUDA call.)"""
    from tierflow.core.errors import TierflowError
    from tierflow.train.device import ComputeTier

    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights
    tier = ComputeTier(torch.device("cuda", 0), False, gpu=1 << 20, ram=None)
    with pytest.raises(TierflowError, match=r"--gpu 1.00 MiB is below the model's 4.00 MiB "
                                            r"of weights: add --disk DIR"):
        tier.place_model(model)
    assert model.weight.device.type == "cpu"


def test_simulated_gpu_matches_the_cpu_run(train_env, tmp_path, capsys):
    """Two tiers (a 64 MiB simulated GPU over RAM) and three (the model waits in host RAM,
    as below a real GPU, every stage's weights stream from there, and the AdamW states, too
    large for what --ram leaves, from the disk below): fp32 losses as on the CPU."""
    disk = tmp_path / "disk"
    disk.mkdir()
    code, _, err = run_main(*train_args(train_env, tmp_path / "cpu"), capsys=capsys)
    assert code == 0, err
    gpu = ("--gpu", "64MiB", "--simulate-gpu", "--ram", "1GiB")
    code, out, err = run_main(*train_args(train_env, tmp_path / "gpu", *gpu), capsys=capsys)
    assert code == 0, err
    assert "gpu (simulated on the CPU); budgets: gpu 64.00 MiB, ram 1.00 GiB" in out, out
    three = ("--gpu", "64MiB", "--simulate-gpu", "--ram", "600KiB", "--disk", str(disk),
             "--stream", "all")  # the weights take 277 KiB of it, the states would take 554
    code, out, err = run_main(*train_args(train_env, tmp_path / "tiers", *three), capsys=capsys)
    assert code == 0, err
    assert "disk tier" in out, out
    plan = records(tmp_path / "tiers" / "log.jsonl", "plan")[-1]
    held = {**plan["ram_tier_bytes"], **plan["disk_bytes"]}  # the [Plan]'s rows per tier
    assert any("streamed stages" in what for what in held), plan
    expected = train_losses(tmp_path / "cpu")
    assert len(expected) == STEPS
    for run in ("gpu", "tiers"):
        torch.testing.assert_close(train_losses(tmp_path / run), expected, rtol=1e-5, atol=0.0)


def _out_of_memory_at(monkeypatch, calls: set[int]) -> None:
    """The fitted module's forward raises a GPU out-of-memory error on these calls (1-based)."""
    from tierflow.exec.module import TierflowModule
    forward = TierflowModule.forward
    count = [0]

    def failing(self, *args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(TierflowModule, "forward", failing)


def test_gpu_out_of_memory_replans_and_retries_the_step_once(train_env, tmp_path, capsys,
                                                             monkeypatch):
    """An out-of-memory error in step 2 re-plans under 80% of the predicted peak and runs
    the step again from its first batch and RNG state: the losses of an undisturbed run.
    A second one in the same step is one line and exit code 2."""
    gpu = ("--gpu", "256MiB", "--simulate-gpu", "--ram", "1GiB", "--seq-len", "128",
           "--batch-size", "8")  # activations enough for a plan under 80% of keep-all's peak
    code, _, err = run_main(*train_args(train_env, tmp_path / "plain", *gpu), capsys=capsys)
    assert code == 0, err
    with monkeypatch.context() as patch:
        _out_of_memory_at(patch, {2})
        code, out, err = run_main(*train_args(train_env, tmp_path / "oom", *gpu), capsys=capsys)
    assert code == 0, err
    assert "the GPU ran out of memory at step 2: re-planned under" in out, out
    replan = records(tmp_path / "oom" / "log.jsonl", "replan")
    assert len(replan) == 1 and replan[0]["gpu_budget"] < 256 << 20
    torch.testing.assert_close(train_losses(tmp_path / "oom"), train_losses(tmp_path / "plain"),
                               rtol=1e-6, atol=0.0)
    with monkeypatch.context() as patch:
        _out_of_memory_at(patch, {2, 3})
        code, _, err = run_main(*train_args(train_env, tmp_path / "twice", *gpu), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["ran out of memory again at step 2", "--gpu"])
