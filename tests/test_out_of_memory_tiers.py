"""A GPU out-of-memory error (injected inside a stage's backward: a CPU never raises one) in
a step of ``tierflow.fit``'s owned optimizer, and of tierflow train --gpu --disk. Before any
stage is updated the step is forgotten (weights fetched ahead, gradients stashed on the lower
tier, micro-batches counted) and runs again under a smaller plan, with the losses of an
undisturbed run; once a stage was updated it cannot run again, and the error names the
checkpoint to resume from."""
from __future__ import annotations

import copy

import pytest
import torch
from cli_support import assert_error_line, fp32_train_args, records, run_main, train_losses
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow.core.config import FitConfig

STEPS = 3


def tiered_args(env, out, disk, *extra):
    """A simulated GPU over host RAM and the disk, every stage's weights streamed, with
    activations enough for a plan under 80% of the first plan's peak."""
    disk.mkdir(exist_ok=True)
    return fp32_train_args(env, out, STEPS, "--gpu", "256MiB", "--simulate-gpu", "--ram",
                           "1GiB", "--disk", str(disk), "--stream", "all", "--seq-len", "128",
                           "--batch-size", "8", *extra)


def _backward_calls(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Count the stage backwards the runner runs; raise a GPU out-of-memory error on call
    ``fail_at`` (1-based) instead of running it."""
    from tierflow.exec.runner import StepRun
    backward = StepRun._backward
    count = [0]

    def counted(self, i):
        count[0] += 1
        if count[0] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return backward(self, i)
    monkeypatch.setattr(StepRun, "_backward", counted)
    return count


def _offloading_tapes(monkeypatch) -> None:
    """Plans that put every tape held across other operations on the lower tier."""
    import dataclasses

    from tierflow.train import planning
    fit_config = planning.fit_config
    monkeypatch.setattr(planning, "fit_config", lambda opts, tier: dataclasses.replace(
        fit_config(opts, tier), offload_tapes="all"))


@pytest.mark.parametrize("accum,tapes", [(1, False), (2, False), (1, True)])
def test_out_of_memory_before_any_update_reruns_the_step(train_env, tmp_path, capsys,
                                                         monkeypatch, accum, tapes):
    """Clipping defers the updates to a pass after the backward: an error in the second
    backward of step 2 (of its last micro-batch, with gradient accumulation) comes before
    any update, so the step runs again under a smaller plan: the undisturbed run's losses.
    Tapes offloaded to host RAM are forgotten too."""
    extra = ("--grad-accum", str(accum))
    if tapes:
        _offloading_tapes(monkeypatch)
    with monkeypatch.context() as patch:
        count = _backward_calls(patch)
        code, _, err = run_main(*tiered_args(train_env, tmp_path / "plain", tmp_path / "d1",
                                             *extra), capsys=capsys)
    assert code == 0, err
    per_step = count[0] // STEPS
    per_micro = per_step // accum
    with monkeypatch.context() as patch:
        _backward_calls(patch, fail_at=per_step + (accum - 1) * per_micro + 2)
        code, out, err = run_main(*tiered_args(train_env, tmp_path / "oom", tmp_path / "d2",
                                               *extra), capsys=capsys)
    assert code == 0, err
    assert "the GPU ran out of memory at step 2: re-planned under" in out, out
    replan = records(tmp_path / "oom" / "log.jsonl", "replan")
    assert len(replan) == 1 and replan[0]["gpu_budget"] < 256 << 20
    plan = records(tmp_path / "oom" / "log.jsonl", "plan")[0]
    assert replan[0]["predicted_peak"] < plan["predicted_peak"]
    assert any("tapes" in what for what in plan["ram_tier_bytes"]) == tapes, plan
    torch.testing.assert_close(train_losses(tmp_path / "oom"), train_losses(tmp_path / "plain"),
                               rtol=1e-6, atol=0.0)


def test_out_of_memory_after_an_update_names_the_checkpoint(train_env, tmp_path, capsys,
                                                            monkeypatch):
    """Without clipping each stage is updated inside the backward: an error after the first
    update cannot be undone by running the step again. One line, exit code 2, naming the
    checkpoint to resume from, which stays as it was: resumed, the run's losses are the
    undisturbed run's."""
    extra = ("--clip", "0", "--save-every", "1")
    with monkeypatch.context() as patch:
        count = _backward_calls(patch)
        code, _, err = run_main(*tiered_args(train_env, tmp_path / "plain", tmp_path / "d1",
                                             *extra), capsys=capsys)
    assert code == 0, err
    per_step = count[0] // STEPS
    with monkeypatch.context() as patch:
        _backward_calls(patch, fail_at=per_step + per_step // 2)
        code, out, err = run_main(*tiered_args(train_env, tmp_path / "oom", tmp_path / "d2",
                                               *extra), capsys=capsys)
    assert code == 2
    checkpoint = tmp_path / "oom" / "step_1"
    assert_error_line(err, ["ran out of memory at step 2 after", "cannot run again",
                            f"--resume {checkpoint}", "smaller --gpu"])
    assert "re-planned" not in out
    code, _, err = run_main(*tiered_args(train_env, tmp_path / "oom", tmp_path / "d2", *extra,
                                         "--resume", str(checkpoint)), capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(tmp_path / "oom")[-STEPS:],
                               train_losses(tmp_path / "plain"), rtol=1e-6, atol=0.0)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_abandoned_step_leaves_every_streamed_weight_on_its_tier(tmp_path, monkeypatch,
                                                                    family):
    """Two micro-batches, the second failing in its backward: ``abandon_step`` drops the
    weights fetched ahead (every streamed stage empty again), the gradients stashed on the
    disk tier and the micro-batch count, so the module then trains as plain PyTorch."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(2)]
    module = tierflow.fit(model, samples[0], optimizer=_adamw, grad_accum=2, max_grad_norm=0.5,
                          disk=tmp_path, config=FitConfig(planner="keep-all", stream="all",
                                                          prefetch_depth=1))
    streamer = module.streamer
    with monkeypatch.context() as patch:
        count = _backward_calls(patch, fail_at=len(module.chain.stages) + 2)
        module(**samples[0]).loss.backward()
        with pytest.raises(torch.OutOfMemoryError):
            module(**samples[1]).loss.backward()
    assert count[0] == len(module.chain.stages) + 2
    assert module.optimizer.updates == 0
    module.abandon_step()
    assert all(p.untyped_storage().nbytes() == 0
               for ps in streamer.stage_params.values() for p in ps)
    assert all(p.grad is None for p in model.parameters())
    train_and_match(module, reference, samples, _adamw)


def _live_storages() -> dict[int, int]:
    """{data pointer: bytes} of every storage a live plain tensor views (not the fake or
    meta tensors other tests' compilers and planners leave behind)."""
    import gc
    import warnings
    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)
                   and not t.is_meta]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("planner", ["keep-all", "rotor"])
def test_an_abandoned_step_keeps_none_of_its_tapes(monkeypatch, planner):
    """A step failing in its second stage backward: once abandoned, nothing of it stays
    alive, above all not the tapes of the stages never backpropagated (saved as
    themselves, an op's outputs would hold their own autograd nodes in a cycle through C++
    that only their backward breaks, for as long as the process lives)."""
    model = tiny_hf("llama", layers=3, dropout=0.0)
    sample = hf_sample()
    module = tierflow.fit(model, sample, config=FitConfig(planner=planner))
    module(**sample).loss.backward()  # a whole step first: what steps keep is there before
    for p in model.parameters():
        p.grad = None
    before = _live_storages()
    with monkeypatch.context() as patch:
        count = _backward_calls(patch, fail_at=2)
        with pytest.raises(torch.OutOfMemoryError):
            module(**sample).loss.backward()
    assert count[0] == 2
    module.abandon_step()
    leaked = {ptr: n for ptr, n in _live_storages().items() if ptr not in before}
    assert not leaked, f"{len(leaked)} storages ({sum(leaked.values())} bytes) still alive"
