"""`tierflow plan --measure`: the chain's costs measured here as `fit` measures them (a copy of
the model with one decoder layer, every layer priced at it), so that the plan it prints is
planned on what the trainer would measure. Each side measures in its own fresh process: the
profiler caches a stage's measurements per process, and a second measurement in the same
one would be the first's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import run_main
from fresh_process import run_in_fresh_process

MIB = 2 ** 20
MODEL, SEQ, BATCH, RAM = "llama-tiny", 128, 2, 1 << 30
# bytes a stage's measured transient moves from one process to the next (RSS readings: the
# LM head's backward read 0 in one process and 6,438,400 B in the other, once in a few runs
# on a loaded 2-core machine)
TRANSIENT_SLACK = 8 * MIB


def measured_costs(out: str) -> None:
    """The costs ``tierflow plan --measure`` plans on, written to ``out`` (a fresh process)."""
    from tierflow.sim.measured import measure
    from tierflow.sim.setup import Setup
    from tierflow.sim.shapes import load_shape
    from test_tiered_prediction import CPU  # measuring reads no hardware profile

    setup = Setup(shape=load_shape(MODEL), hardware=CPU, seq=SEQ, batch=BATCH, ram=RAM,
                  disk=True, precision=_precision())
    measured = measure(MODEL, setup)
    Path(out).write_text(json.dumps({chunk: c.to_dict() for chunk, c in
                                     measured.costs.items()}))


def _precision():
    """`tierflow train`'s default precision on this machine: fp32 weights, the matmuls in
    bf16 (autocast) where the CPU multiplies bf16 natively, else in fp32 (on AVX2 alone
    bf16 runs a scalar fallback, and this test took a minute of the suite)."""
    from tierflow.precision.config import PrecisionConfig
    from tierflow.profile.machine import default_matmul_dtype

    return PrecisionConfig("fp32", "fp32", "fp32", default_matmul_dtype())


def fitted_costs(out: str, disk: str) -> None:
    """The costs ``fit`` plans the whole model on, as `tierflow train` calls it (fp32
    weights, its default matmul dtype, tierflow's AdamW, a RAM budget over a disk tier), to
    ``out``."""
    import torch

    from tierflow import fit
    from tierflow.models.load import random_init
    from tierflow.precision import make_optimizer

    model = random_init(MODEL, vocab_size=None, dtype=torch.float32, seed=0)
    window = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
    sample = {"input_ids": window[:, :-1], "shift_labels": window[:, 1:]}
    precision = _precision()
    with torch.autocast("cpu", dtype=torch.bfloat16,
                        enabled=precision.matmul_dtype == "bf16"):
        module = fit(model, sample, ram=RAM, disk=disk,
                     optimizer=lambda ps: make_optimizer([{"params": list(ps)}], precision,
                                                         lr=1e-4))
    costs = module.plan.costs
    Path(out).write_text(json.dumps({costs.extra["head chunk"] if "head chunk" in costs.extra
                                     else "fit": costs.to_dict()}))


def test_measured_stages_are_the_ones_fit_profiles(tmp_path):
    """Every decoder layer's bytes (tape, output, parameters, its selective tape) are what
    ``fit`` measured for that layer of the whole model; transients within a few MiB; the
    static bytes hold the whole model's parameters; one stage per layer. (Times are not
    compared: a stage of milliseconds moves by 5x between two processes on a busy machine.)"""
    run_in_fresh_process("test_plan_measured", "measured_costs", str(tmp_path / "m.json"))
    (tmp_path / "disk").mkdir()
    run_in_fresh_process("test_plan_measured", "fitted_costs", str(tmp_path / "f.json"),
                         str(tmp_path / "disk"))
    measured = json.loads((tmp_path / "m.json").read_text())
    fitted = next(iter(json.loads((tmp_path / "f.json").read_text()).values()))
    ours = measured.get(str(fitted.get("extra", {}).get("head chunk", 1024)),
                        measured["1024"])
    assert len(ours["stages"]) == len(fitted["stages"]) == 2 + 2
    for mine, theirs in zip(ours["stages"], fitted["stages"]):
        assert mine["name"] == theirs["name"]
        for key in ("tape", "output_bytes", "param_bytes"):
            assert mine[key] == theirs[key], (mine["name"], key)
        for key in ("fwd_transient", "fwd_transient_nograd", "bwd_transient"):
            assert abs(mine[key] - theirs[key]) <= TRANSIENT_SLACK, (mine["name"], key)
        if theirs.get("selective"):
            assert mine["selective"]["tape"] == theirs["selective"]["tape"]
        assert mine["fwd_time"] > 0 and (mine["bwd_time"] > 0) == (theirs["bwd_time"] > 0)
    assert ours["static_bytes"] >= ours["extra"]["parameters"] == \
        fitted["extra"]["parameters"]


def test_plan_measure_says_what_it_measured(capsys, tmp_path):
    code, out, err = run_main("plan", "--model", "llama-tiny", "--hardware", "cpu",
                              "--seq-len", "64", "--ram", "1GiB", "--disk", str(tmp_path),
                              "--measure", capsys=capsys)
    assert code == 0, err
    assert "a one-layer copy ran to measure it" in out
    assert "every stage measured here" in out and "costs measured here" in out
    code, out, err = run_main("plan", "--model", "llama-tiny", "--hardware", "cpu",
                              "--seq-len", "64", "--measure", "--json", capsys=capsys)
    assert code == 0, err
    prediction = json.loads(out)
    assert prediction["costs"] == "measured" and prediction["placement"]["stages"] == 2 + 2


@pytest.mark.parametrize("args, fragment", [
    (["--hardware", "h100-sxm"], "--hardware h100-sxm is a profile of another"),
    (["--freeze", "model.embed_tokens.*"], "leave --freeze and --train-only out"),
])
def test_plan_measure_refuses_what_it_cannot_measure(args, fragment, capsys):
    code, out, err = run_main("plan", "--model", "llama-tiny", "--seq-len", "64", "--measure",
                              *args, capsys=capsys)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_a_model_whose_layers_differ_is_not_measured(monkeypatch):
    """One measured layer cannot price layers of other kinds (a dense first layer before MoE
    ones, sliding and full attention)."""
    from tierflow.core.errors import TierflowError
    from tierflow.models.presets import preset_config
    from tierflow.sim import measured

    config = preset_config("llama-tiny")
    config.layer_types = ["sliding_attention", "full_attention"]
    monkeypatch.setattr(measured, "model_config", lambda spec: config)
    with pytest.raises(TierflowError, match="its layers differ"):
        measured._one_layer_model("llama-tiny", None)



def test_after_a_training_run_plan_measure_prints_the_plan_it_ran(train_env, tmp_path,
                                                                  capsys):
    """`tierflow train` keeps what it measured (profile/kept_profiles.py); `tierflow plan
    --measure` of the same run plans on that, under the trainer's budget (--ram less what
    its process held outside the plan), and prints the plan the run ran: its decisions (what
    goes to the disk tier among them), its predicted step."""
    import torch
    from cli_support import fp32_train_args, records
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        # 13M parameters: their weights and AdamW states alone take 149 MiB, so at 160 MiB
        # (with the runtime's 16) some go to the disk tier whatever the process held before
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=304, hidden_size=512, intermediate_size=1408,
                             num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512)
        LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    disk = tmp_path / "disk"
    disk.mkdir()
    run = fp32_train_args(train_env, tmp_path / "run", 1, "--ram", "160MiB",
                          "--disk", str(disk))
    run[run.index("--model") + 1], run[run.index("--seq-len") + 1] = str(tmp_path / "model"), "128"
    code, _, err = run_main(*run, capsys=capsys)
    assert code == 0, err
    [ran] = records(tmp_path / "run" / "log.jsonl", "plan")
    assert ran["decisions"]["transfer_ops"]  # what moves to the disk tier varies by process
    code, out, err = run_main("plan", "--model", str(tmp_path / "model"), "--hardware", "cpu",
                              "--ram", "160MiB", "--disk", str(disk), "--seq-len", "128",
                              "--batch-size", "2", "--matmul-dtype", "fp32", "--measure",
                              "--json", capsys=capsys)
    assert code == 0, err
    prediction = json.loads(out)
    assert prediction["costs"] == "trainer"
    assert prediction["placement"]["decisions"] == ran["decisions"]
    assert prediction["step_time"] == pytest.approx(ran["predicted_step_s"], rel=1e-9)
    # the peak as the run's RSS sees it: the plan's, and what the process held outside it
    assert prediction["placement"]["peaks"]["ram"] == \
        ran["predicted_peak"] + ran["held_outside_the_plan"]
