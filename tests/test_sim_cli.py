"""tierflow plan / sweep / calibrate from the command line, and the hardware profiles."""
import csv
import dataclasses
import json
import time

import pytest
from cli_support import assert_error_line, run_main

from tierflow.sim.hardware import PUBLISHED, Hardware, effective_flops

H100 = ["--hardware", "h100-sxm", "--model", "llama3-8b"]


def test_plan_prints_a_labelled_prediction(capsys):
    code, out, err = run_main("plan", *H100, "--gpu", "24", "--ram", "64", "--seq-len", "8192",
                              "--grad-accum", "16", "--model-dtype", "bf16", "--master", "none",
                              "--optim-dtype", "bf16", capsys=capsys)
    assert code == 0, err
    assert "PREDICTED" in out
    for field in ("weights", "gradients", "optimizer states", "activations", "peak gpu",
                  "peak ram", "step time", "tokens/s", "MFU", "bottleneck", "smallest budgets"):
        assert field in out, field


def test_plan_json(capsys):
    code, out, _ = run_main("plan", *H100, "--seq-len", "4096", "--json", capsys=capsys)
    assert code == 0
    data = json.loads(out)
    assert data["predicted"] is True and data["tokens_per_second"] > 0
    assert data["placement"]["peaks"]["gpu"] <= 80 * 2 ** 30
    decisions = data["placement"]["decisions"]  # the plan's own, as the trainer logs them
    assert decisions["strategy"] in ("keep-all", "checkpoint-all", "rotor")
    assert set(decisions) >= {"recomputed", "streamed", "states_home", "tapes"}


@pytest.mark.parametrize("clip, deferred", [([], True), (["--clip", "0"], False)])
def test_plan_defers_the_updates_when_it_clips_as_train_does(clip, deferred, capsys):
    """tierflow train clips the global norm by default (--clip 1.0), so its updates wait for
    the whole backward: plan predicts the same, and the updates inside the backward only
    with --clip 0."""
    code, out, err = run_main("plan", *H100, "--seq-len", "4096", *clip, "--json",
                              capsys=capsys)
    assert code == 0, err
    placement = json.loads(out)["placement"]
    assert placement["decisions"]["deferred_updates"] is deferred
    assert ("update pass" in placement["times"]) is deferred


@pytest.mark.parametrize("args, fragments", [
    (["--model", "qwen2.5-0.5b", "--gpu", "1", "--ram", "2", "--seq-len", "4096"],  # fast
     ["nothing fits gpu 1.00 GiB, ram 2.00 GiB", "needs at least"]),
    (["--gpu", "lots", "--seq-len", "4096"], ["--gpu", "GiB"]),
    (["--seq-len", "0"], ["--seq-len", "at least 1"]),
    (["--seq-len", "4096", "--matmul-dtype", "fp8", "--hardware", "a100-80gb"],
     ["fp8", "a100-80gb"]),
    (["--seq-len", "1024,2048"], ["--seq-len '1024,2048'", "give one value", "tierflow sweep"]),
    (["--seq-len", "64", "--batch-size", "x"], ["--batch-size 'x'", "e.g. --batch-size 4"]),
    (["--seq-len", "64", "--clip", "-1"], ["--clip -1.0", "positive norm"]),
])
def test_plan_user_errors_are_one_line_exit_2(args, fragments, capsys):
    code, _, err = run_main("plan", "--model", "llama3-8b", "--hardware", "h100-sxm", *args,
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, fragments)


def test_plan_unknown_model_and_gpu_on_cpu(capsys, tmp_path):
    code, _, err = run_main("plan", "--model", str(tmp_path / "nope"), "--hardware", "rtx4090",
                            "--seq-len", "128", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["neither a preset"])
    code, _, err = run_main("plan", "--model", "llama-20m", "--hardware", "cpu", "--gpu", "8",
                            "--seq-len", "128", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--gpu 8", "no GPU"])  # at once, before measuring the cpu profile


@pytest.mark.exclusive  # timed
def test_sweep_writes_every_configuration_and_a_heatmap_per_model_and_length(tmp_path, capsys):
    """12 configurations, each planned by the trainer's own search (one process per core),
    in under 60 s on the 2-core development machine."""
    started = time.perf_counter()
    code, _, err = run_main("sweep", "--hardware", "h100-sxm", "--gpu", "8,24,80",
                              "--ram", "32,256", "--seq-len", "4096",
                              "--model", "llama3.2-1b,llama3-8b", "-o", str(tmp_path),
                              capsys=capsys)
    elapsed = time.perf_counter() - started
    assert code == 0, err
    assert elapsed < 60, f"the sweep took {elapsed:.1f} s"
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    fits = [r for r in rows if r["fits"] == "True"]
    assert fits and len(fits) < 12  # 8B on 8 GiB GPU + 32 GiB RAM cannot fit
    assert all(float(r["tokens_per_s"]) > 0 for r in fits)
    assert all(r["bottleneck"] for r in rows)  # why, for the ones that do not fit
    assert len(list(tmp_path.glob("*.png"))) == 2
    # more memory never predicts fewer tokens/s (to within 0.5%)
    for r in fits:
        bigger = [s for s in fits if s["model"] == r["model"] and s["seq_len"] == r["seq_len"]
                  and float(s["gpu_gib"]) >= float(r["gpu_gib"])
                  and float(s["ram_gib"]) >= float(r["ram_gib"])]
        assert all(float(s["tokens_per_s"]) >= float(r["tokens_per_s"]) * 0.995 for s in bigger)


@pytest.mark.exclusive  # measures the machine
def test_calibrate_then_plan_on_cpu(capsys):
    code, out, err = run_main("calibrate", capsys=capsys)
    assert code == 0, err
    for field in ("matmul fp32", "matmul bf16", "memcpy", "disk read", "disk write",
                  "(fp32 moments)", "(bf16 moments)", "(int8 moments)"):
        assert field in out
    code, out, err = run_main("plan", "--model", "llama-20m", "--hardware", "cpu", "--ram",
                              "2GiB", "--seq-len", "256", "--batch-size", "2", capsys=capsys)
    assert code == 0 and "no calibration" not in err  # the cached profile was used
    assert "peak ram" in out and "PREDICTED" in out


@pytest.mark.parametrize("busy", [False, True])
def test_a_calibration_is_kept_only_when_other_processes_left_the_cpus_quiet(
        busy, capsys, monkeypatch, tmp_path):
    """One busy process on a 2-core machine halved the rates a calibration measured: such a
    profile serves the command that measured it and is not cached; a quiet one is."""
    from tierflow.profile import machine
    from tierflow.sim import calibrate

    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path))  # not the session's calibration
    # stands for this machine's figures (no minute of measuring)
    measured = dataclasses.replace(PUBLISHED["l40s"], name="cpu", gpu_bytes=None,
                                   host_link_bw=None, attention_efficiency=0.4,
                                   ram_bytes=16 << 30,
                                   optimizer_bw={"fp32": 5e9, "bf16": 6e9, "int8": 1e9})
    monkeypatch.setattr(calibrate, "_measure", lambda directory: measured)
    monkeypatch.setattr(calibrate, "Quiet", machine.Quiet)  # the suite's is always quiet
    monkeypatch.setattr(machine, "_others_were_busy", lambda before, after: busy)
    code, out, err = run_main("calibrate", capsys=capsys)
    assert code == 0, err
    assert calibrate.cached_profile() == (None if busy else measured)
    assert ("not kept: the machine was busy" in out) == busy
    assert ("run 'tierflow calibrate' when the machine is quiet" in err) == busy


def test_hardware_profiles_round_trip_and_state_their_efficiency():
    for hw in PUBLISHED.values():
        assert Hardware.from_json(hw.to_json()) == hw
        assert any("efficiency" in note for note in hw.notes)
        assert effective_flops(hw, "bf16") < hw.peak_flops["bf16"]
    assert "fp8" not in PUBLISHED["a100-80gb"].peak_flops
    h100 = PUBLISHED["h100-sxm"]  # no measured AdamW rates: the host's memory rate for all
    assert h100.update_bw("bf16") == h100.update_bw("fp32") == h100.host_memory_bw
    assert PUBLISHED["h100-sxm"].peak_flops["bf16"] == 989e12


@pytest.mark.parametrize("bf16_peak, matmuls", [(4e11, "bf16"), (3e8, "fp32")])
def test_a_cpu_profile_defaults_to_its_faster_matmul_dtype(bf16_peak, matmuls):
    """As the trainer: bf16 autocast where bf16 is native (faster than fp32), fp32 where bf16
    runs in PyTorch's fallback kernels (0.3 GFLOP/s against 77 in fp32 on an AVX2 CPU)."""
    from dataclasses import replace

    from tierflow.precision.config import PrecisionConfig
    from tierflow.sim.setup import default_precision
    cpu = replace(PUBLISHED["h100-sxm"], name="cpu", gpu_bytes=None, host_link_bw=None,
                  peak_flops={"fp32": 1.3e11, "bf16": bf16_peak})
    assert default_precision(cpu) == PrecisionConfig(matmul_dtype=matmuls)
    assert default_precision(PUBLISHED["h100-sxm"]).matmul_dtype == "bf16"


@pytest.mark.parametrize("command, args, fragment", [
    ("plan", ["--seq-len", "0"], "--seq-len '0'"),
    ("plan", ["--seq-len", "64", "--ram", "lots"], "--ram 'lots'"),
    ("plan", ["--seq-len", "64", "--grad-accum", "1,2"], "--grad-accum '1,2'"),
    ("sweep", ["--seq-len", "64,x", "-o", "{tmp}"], "--seq-len '64,x'"),
    ("sweep", ["--seq-len", "64", "--ram", "8,lots", "-o", "{tmp}"], "--ram 'lots'"),
    ("sweep", ["--seq-len", "64", "--disk", "{tmp}/nope", "-o", "{tmp}"], "--disk"),
])
def test_flags_are_refused_before_the_cpu_profile_is_measured(command, args, fragment,
                                                              monkeypatch, capsys, tmp_path):
    """The cpu profile imports torch and may measure for seconds: bad flags come first."""
    from tierflow.sim import options

    def unreachable(name):
        raise AssertionError(f"the {name} profile was asked for")
    monkeypatch.setattr(options, "hardware", unreachable)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, _, err = run_main(command, "--model", "llama-20m", *args, capsys=capsys)
    assert code == 2
    assert_error_line(err, [fragment])
