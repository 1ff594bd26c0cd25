"""tierflow train --disk: weights and AdamW states on the disk tier give the losses of the
in-memory run; its checkpoints are the same format (resume across the two, either way);
--trace writes the executed steps; the disk tier's errors are one line."""
from __future__ import annotations

import json
import os

import pytest
import torch
from cli_support import assert_error_line, fp32_train_args, records, run_main, train_losses
from safetensors.torch import load_file

STEPS = 4


def train_args(env, out, *extra):
    return fp32_train_args(env, out, STEPS, "--save-every", "2", *extra)


def train(capsys, *args) -> str:
    code, out, err = run_main(*args, capsys=capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize("grad_accum", ["1", "2"])
def test_disk_run_matches_the_in_memory_run(train_env, tmp_path, capsys, grad_accum):
    """fp32, every stage streamed (--stream all): the same losses, gradient norms and
    weights as the in-memory run, with accumulation 1 (updates in the backward, clipped:
    one pass after it) and 2."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train(capsys, *train_args(train_env, tmp_path / "ram", "--grad-accum", grad_accum))
    out = train(capsys, *train_args(train_env, tmp_path / "disk-run", "--grad-accum",
                                    grad_accum, "--disk", str(disk), "--stream", "all",
                                    "--trace", str(tmp_path / "trace.json")))
    assert "disk tier" in out and "streamed stages" in out, out
    ram, on_disk = train_losses(tmp_path / "ram"), train_losses(tmp_path / "disk-run")
    assert len(ram) == STEPS
    torch.testing.assert_close(on_disk, ram, rtol=1e-5, atol=0.0)
    norms = [[r["norm"] for r in records(tmp_path / run / "log.jsonl", "train")]
             for run in ("ram", "disk-run")]
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=0.0)
    final = [load_file(str(tmp_path / run / f"step_{STEPS}" / "model.safetensors"))
             for run in ("ram", "disk-run")]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        torch.testing.assert_close(final[1][name], final[0][name], rtol=1e-4, atol=1e-6)
    assert list(disk.iterdir()) == []  # the run's scratch directory is gone
    spans, rows = trace_sides(tmp_path / "trace.json")
    reads = [e for e in spans["measured"] if e["tid"] == rows["disk read"]]
    assert any(e["name"].startswith("load(w") for e in reads)
    assert any(e["name"].startswith("load(s") for e in reads)  # optimizer states
    # the plan's predicted spans, op by op beside the measured ones of the same names
    predicted = {e["name"] for e in spans["predicted"]}
    assert any(name.startswith("load(w") for name in predicted)
    assert predicted <= {e["name"] for e in spans["measured"]}
    [record] = records(tmp_path / "disk-run" / "log.jsonl", "trace")
    assert {"compute", "disk read"} <= set(record["busy_s"])
    # the disk's reads and writes take turns in the plan: its busy time is theirs together
    disk_busy = record["busy_s"]["disk (disk read, disk write)"]
    busy = record["busy_s"]
    assert disk_busy["predicted"] == pytest.approx(
        busy["disk read"]["predicted"] + busy["disk write"]["predicted"])
    assert disk_busy["measured"] <= busy["disk read"]["measured"] \
        + busy["disk write"]["measured"] + 1e-9
    [plan] = records(tmp_path / "disk-run" / "log.jsonl", "plan")  # what the run decided
    assert plan["decisions"]["weights_home"] == "disk" and plan["decisions"]["streamed"]


def trace_sides(path) -> tuple[dict, dict]:
    """The measured and the predicted spans of a trace, by process, and its rows by name."""
    trace = json.loads(path.read_text())["traceEvents"]
    process = {e["args"]["name"]: e["pid"] for e in trace if e["name"] == "process_name"}
    rows = {e["args"]["name"]: e["tid"] for e in trace if e["name"] == "thread_name"}
    spans = {kind: [e for e in trace if e["ph"] == "X" and e["pid"] == pid]
             for kind, pid in process.items()}
    return spans, rows


def test_a_simulated_gpu_over_ram_and_disk_traces_predicted_beside_measured(train_env,
                                                                           tmp_path, capsys):
    """Three tiers (a simulated GPU over host RAM over a disk, the weights on disk): the
    trace holds the plan's predicted spans beside the measured ones, op by op under the same
    names, each on the row of the resource that runs it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    train(capsys, *train_args(train_env, tmp_path / "run", "--gpu", "64MiB", "--simulate-gpu",
                              "--ram", "48KiB", "--disk", str(disk), "--stream", "all",
                              "--trace", str(tmp_path / "trace.json")))
    spans, rows = trace_sides(tmp_path / "trace.json")
    names = {side: {e["name"] for e in spans[side]} for side in ("measured", "predicted")}
    assert any(name.startswith("load(w") and "disk>gpu" in name for name in names["predicted"])
    assert names["predicted"] <= names["measured"]
    measured_rows = {e["name"]: e["tid"] for e in spans["measured"]}
    for e in spans["predicted"]:  # the same op on the same resource's row
        assert measured_rows[e["name"]] == e["tid"], e["name"]
    [record] = records(tmp_path / "run" / "log.jsonl", "trace")
    assert {"compute", "disk read"} <= set(record["busy_s"]) and "disk read" in rows


LOW_PRECISION = {"bf16-weights": ("--model-dtype", "bf16", "--dtype", "bf16",  # the last wins
                                   "--master", "fp32"),
                 "int8-moments": ("--optim-dtype", "int8")}
STOCHASTIC_ROUNDING = {"bf16-moments": ("--optim-dtype", "bf16"),
                       "bf16-weights-no-master": ("--model-dtype", "bf16", "--dtype", "bf16",
                                                  "--master", "none")}


@pytest.mark.parametrize("grad_accum", ["1", "2"])
@pytest.mark.parametrize("precision", sorted(LOW_PRECISION))
def test_low_precision_disk_run_matches_the_in_memory_run(train_env, tmp_path, capsys,
                                                          precision, grad_accum):
    """bf16 weights (cast as they go to disk, their fp32 master among the AdamW states on
    disk) and int8 AdamW moments: without clipping, the --disk run's losses are the in-memory
    run's to the bit, and its checkpoint holds the same tensors; with clipping the global
    norm is summed in another order, and bf16 weights round that difference up to a few
    units in the 5th digit of the loss."""
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = LOW_PRECISION[precision]
    for clip in ("0", "1"):
        ram, on_disk = tmp_path / f"ram-{clip}", tmp_path / f"disk-{clip}"
        common = ("--grad-accum", grad_accum, "--clip", clip, *flags)
        train(capsys, *train_args(train_env, ram, *common))
        out = train(capsys, *train_args(train_env, on_disk, *common, "--disk", str(disk),
                                        "--stream", "all"))
        assert "streamed stages" in out, out
        tolerance = dict(rtol=0.0, atol=0.0) if clip == "0" else dict(rtol=2e-4, atol=0.0)
        torch.testing.assert_close(train_losses(on_disk), train_losses(ram), **tolerance)
    saved = [load_file(str(tmp_path / run / f"step_{STEPS}" / name))
             for run in ("ram-0", "disk-0") for name in ("model.safetensors",
                                                        "optimizer.safetensors")]
    for expected, got in ((saved[0], saved[2]), (saved[1], saved[3])):
        assert expected.keys() == got.keys()
        for name in expected:
            assert got[name].dtype == expected[name].dtype, name
            torch.testing.assert_close(got[name], expected[name], rtol=0.0, atol=0.0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    if precision == "bf16-weights":
        assert saved[0]["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
        assert any("master" in name for name in saved[1]), sorted(saved[1])[:8]


@pytest.mark.parametrize("grad_accum", ["1", "2"])
def test_fp8_matmuls_on_disk_match_the_in_memory_run(train_env, tmp_path, capsys, grad_accum):
    """fp8 decoder Linears hold the Linears' own Parameters, so their weights stream like any
    other: every stage streamed from disk gives the in-memory fp8 run's losses and checkpoint
    to the bit (unclipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = ("--dtype", "bf16", "--matmul-dtype", "fp8", "--clip", "0", "--grad-accum",
             grad_accum)
    train(capsys, *train_args(train_env, tmp_path / "ram", *flags))
    out = train(capsys, *train_args(train_env, tmp_path / "disk-run", *flags, "--disk",
                                    str(disk), "--stream", "all"))
    assert "streamed stages" in out and "matmuls fp8" in out, out
    assert train_losses(tmp_path / "disk-run") == train_losses(tmp_path / "ram")
    for name in ("model.safetensors", "optimizer.safetensors"):
        expected, got = (load_file(str(tmp_path / run / f"step_{STEPS}" / name))
                         for run in ("ram", "disk-run"))
        assert expected.keys() == got.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), name


def test_compiled_layers_on_disk_match_the_in_memory_compiled_run(train_env, tmp_path,
                                                                    capsys, monkeypatch):
    """torch.compile'd decoder layers read their streamed weights as graph inputs (the
    parameters are the compiled kernel's arguments): every stage streamed from disk gives
    the in-memory compiled run's losses to the bit."""
    from tierflow.fitting import profile_step as api
    compiled, real = [], api.compile_chain

    def counting(chain):  # how many stages each plan's chain compiled
        compiled.append(real(chain))
        return compiled[-1]
    monkeypatch.setattr(api, "compile_chain", counting)
    disk = tmp_path / "disk"
    disk.mkdir()
    train(capsys, *train_args(train_env, tmp_path / "ram", "--compile"))
    out = train(capsys, *train_args(train_env, tmp_path / "disk-run", "--compile", "--disk",
                                    str(disk), "--stream", "all"))
    assert "streamed stages" in out, out
    assert len(compiled) >= 2 and compiled[-1] == 2, compiled  # both decoder layers
    assert train_losses(tmp_path / "disk-run") == train_losses(tmp_path / "ram")


@pytest.mark.parametrize("precision", ["fp32", "bf16-weights"])
def test_checkpoints_resume_across_disk_and_memory(train_env, tmp_path, capsys, precision):
    """A --disk checkpoint resumes in memory and an in-memory one resumes with --disk, each
    giving the uninterrupted run's losses: both write the single-process format (with bf16
    weights, their fp32 master among the optimizer states; unclipped, see above)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    on_disk = ("--disk", str(disk), "--stream", "all")
    flags = LOW_PRECISION[precision] + ("--clip", "0") if precision in LOW_PRECISION else ()
    train(capsys, *train_args(train_env, tmp_path / "ram", *flags))
    train(capsys, *train_args(train_env, tmp_path / "disk-run", *on_disk, *flags))
    expected = train_losses(tmp_path / "ram")[2:]
    out = train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
                str(tmp_path / "to-ram"), "--disk", "none")
    options = records(tmp_path / "to-ram" / "log.jsonl", "options")[-1]
    assert "disk tier" not in out and options["disk"] is None and options["stream"] == "auto"
    train(capsys, "train", "--resume", str(tmp_path / "ram" / "step_2"), "--out",
          str(tmp_path / "to-disk"), *on_disk)
    for run in ("to-ram", "to-disk"):
        torch.testing.assert_close(train_losses(tmp_path / run), expected, rtol=1e-5, atol=0.0)
    names = [load_file(str(tmp_path / run / "step_2" / "optimizer.safetensors")).keys()
             for run in ("ram", "disk-run")]
    assert set(names[0]) == set(names[1])


@pytest.mark.parametrize("precision", sorted(STOCHASTIC_ROUNDING))
def test_stochastic_rounding_on_disk_resumes_bit_for_bit(train_env, tmp_path, capsys,
                                                         precision):
    """bf16 moments, or bf16 weights without a master: every stage's optimizer rounds with
    one shared generator, saved as the checkpoint's one generator. A --disk run resumed with
    --disk continues bit for bit; its checkpoint has the in-memory run's tensors (so it
    resumes in memory too); the stages draw their random numbers in another order than the
    in-memory optimizer, so the losses agree only to rounding noise."""
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = STOCHASTIC_ROUNDING[precision]
    on_disk = ("--disk", str(disk), "--stream", "all")
    train(capsys, *train_args(train_env, tmp_path / "ram", *flags))
    train(capsys, *train_args(train_env, tmp_path / "disk-run", *flags, *on_disk))
    resumed = tmp_path / "resumed"
    train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
          str(resumed), *on_disk)
    uninterrupted = train_losses(tmp_path / "disk-run")
    torch.testing.assert_close(train_losses(resumed), uninterrupted[2:], rtol=0.0, atol=0.0)
    ram = train_losses(tmp_path / "ram")
    assert uninterrupted[0] == ram[0]  # before any update
    torch.testing.assert_close(uninterrupted, ram, rtol=1e-3, atol=0.0)
    names = [load_file(str(tmp_path / run / "step_2" / "optimizer.safetensors")).keys()
             for run in ("ram", "disk-run")]
    assert set(names[0]) == set(names[1]) and "opt.0.generator" in names[1]
    train(capsys, "train", "--resume", str(tmp_path / "disk-run" / "step_2"), "--out",
          str(tmp_path / "to-ram"), "--disk", "none")
    torch.testing.assert_close(train_losses(tmp_path / "to-ram"), ram[2:], rtol=1e-3, atol=0.0)


def test_disk_errors_are_one_line(train_env, tmp_path, capsys):
    missing = tmp_path / "missing"
    code, _, err = run_main(*train_args(train_env, tmp_path / "a", "--disk", str(missing)),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, [str(missing), "does not exist"])
    code, _, err = run_main(*train_args(train_env, tmp_path / "b", "--stream", "all"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--stream all", "--disk"])
    code, _, err = run_main(*train_args(train_env, tmp_path / "b", "--serial-reads"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--serial-reads", "--disk DIR"])
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_a_full_disk_tier_mid_run_is_one_line_and_keeps_the_checkpoint(train_env, tmp_path,
                                                                        capsys, monkeypatch):
    """The disk tier fills up after the step-2 checkpoint: one line naming the directory and
    the fix, exit code 2, step_2 intact and nothing later written."""
    import errno

    from tierflow.train import checkpoint as ckpt_module
    disk = tmp_path / "disk"
    disk.mkdir()
    full = [False]
    save, sync, pwrite = ckpt_module.save_checkpoint, os.fdatasync, os.pwrite

    def save_then_fill(*args, **kwargs):
        path = save(*args, **kwargs)
        full[0] = True
        return path

    def failing(call):  # a direct write fails in pwrite, one through the page cache at sync
        def after_the_checkpoint(*args):
            if full[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return call(*args)
        return after_the_checkpoint
    monkeypatch.setattr(ckpt_module, "save_checkpoint", save_then_fill)
    monkeypatch.setattr(os, "fdatasync", failing(sync))
    monkeypatch.setattr(os, "pwrite", failing(pwrite))
    out = tmp_path / "run"
    code, _, err = run_main(*train_args(train_env, out, "--disk", str(disk), "--stream", "all"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, [f"the disk tier {disk}", "is full", "free space there"])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_2"]
    state = load_file(str(out / "step_2" / "model.safetensors"))
    assert state and all(torch.isfinite(t).all() for t in state.values())
    assert list(disk.iterdir()) == []
