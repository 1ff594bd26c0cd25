"""The disk tier's budget is its directory's free space, read the same way by `tierflow plan
--disk` and by the trainer (``profile.machine.disk_free_bytes``): both searches see the same
placements (those keeping a few stages whole beside the disk need a budget), and a disk too
small for a placement refuses it in one line that names the space to free."""
from __future__ import annotations

import json

import torch
from cli_support import assert_error_line, fp32_train_args, run_main
from models import tiny_hf

from tierflow import load_model
from tierflow.exec.offload import offloaded_parameters
from tierflow.fitting import tiers as fitting_tiers
from tierflow.fitting.tiers import lower_tiers
from tierflow.profile.machine import disk_free_bytes

# the free space moves while a test runs (other files come and go): within this it is the same
SLACK = 256 << 20


def test_the_trainer_budgets_the_disk_at_its_free_space(tmp_path):
    [disk], stores = lower_tiers(torch.device("cpu"), tmp_path, None, False, None)
    assert disk.name == "disk" and disk.budget is not None
    assert abs(disk.budget - disk_free_bytes(tmp_path)) < SLACK
    assert stores["disk"].directory == tmp_path


def test_a_model_built_on_the_disk_counts_its_own_files_in_the_budget(tmp_path):
    """Its weights are already there: the budget is the free space and their bytes, which
    the plan counts as held on the disk."""
    tiny_hf("llama", layers=2).save_pretrained(tmp_path / "model")
    model = load_model(tmp_path / "model", disk=tmp_path)
    offloaded = offloaded_parameters(model)
    assert offloaded is not None and offloaded.store.bytes > 0
    [disk], stores = lower_tiers(torch.device("cpu"), tmp_path, None, False, offloaded)
    assert stores["disk"] is offloaded.store
    own = offloaded.store.bytes
    assert abs(disk.budget - (disk_free_bytes(tmp_path) + own)) < SLACK


def test_plan_prints_the_disk_budget_the_trainer_plans_with(tmp_path, capsys):
    code, out, err = run_main("plan", "--model", "llama-134m", "--hardware", "cpu", "--ram",
                              "2GiB", "--disk", str(tmp_path), "--seq-len", "256", "--json",
                              capsys=capsys)
    assert code == 0, err
    budget = json.loads(out)["placement"]["budgets"]["disk"]
    [disk], _ = lower_tiers(torch.device("cpu"), tmp_path, None, False, None)
    assert abs(budget - disk.budget) < SLACK


def test_a_disk_too_small_for_the_placement_is_one_line(train_env, tmp_path, capsys,
                                                         monkeypatch):
    """Every stage's weights and states on a disk with 4 KiB free (beside the model's own
    files, which the run wrote there): refused before training, naming the disk's budget,
    what the placement keeps there and the fix."""
    monkeypatch.setattr(fitting_tiers, "disk_free_bytes", lambda directory: 4096)
    disk = tmp_path / "disk"
    disk.mkdir()
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "out", 2, "--disk",
                                             str(disk), "--stream", "all"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["disk budget", "this placement keeps there", str(disk),
                            "free space in the disk tier", "or give a directory with at least"])
    assert not (tmp_path / "out" / "step_2").exists()
