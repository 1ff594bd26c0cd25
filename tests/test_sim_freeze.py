"""`tierflow plan/sweep --freeze/--train-only`: the simulator's partial fine-tune against the
real models (stage ownership, FLOPs under torch's counter), the profiler's costs of the same
frozen model, and the command line."""
import csv
from dataclasses import replace

import pytest
import torch
from cli_support import assert_error_line, run_main
from models import hf_config, hf_sample
from torch.utils.flop_counter import FlopCounterMode

from tierflow.core.errors import TierflowError
from tierflow.models.freeze import freeze_parameters
from tierflow.precision.config import PrecisionConfig
from tierflow.sim.freeze import selection_for
from tierflow.sim.hardware import PUBLISHED, Hardware
from tierflow.sim.predict import predict
from tierflow.sim.selection import Selection
from tierflow.sim.setup import Setup, default_precision
from tierflow.sim.shapes import load_shape
from tierflow.sim.stages import StepShape, chain_costs, step_flops

GIB = 2 ** 30
FAMILIES = ("llama", "qwen2", "gpt2", "gpt_neox", "mistral")
FP32 = PrecisionConfig()  # fp32 weights, moments and matmuls
# a cpu profile of round numbers (a real one is measured by `tierflow calibrate`)
CPU = Hardware(name="cpu", about="test", gpu_bytes=None, peak_flops={"fp32": 1e11, "bf16": 4e11},
               memory_bw=10e9, host_link_bw=None, host_memory_bw=10e9, disk_read_bw=2e9,
               disk_write_bw=1e9, matmul_efficiency=0.8, memory_efficiency=0.4,
               attention_efficiency=0.2)


def saved(family: str, tmp_path, layers: int = 3) -> str:
    """A directory holding the config.json of a tiny ``family`` model."""
    hf_config(family, layers=layers).save_pretrained(tmp_path)
    return str(tmp_path)


def layer_glob(family: str, i: int) -> str:
    return {"gpt2": f"transformer.h.{i}.*", "gpt_neox": f"gpt_neox.layers.{i}.*"}.get(
        family, f"model.layers.{i}.*")


@pytest.mark.parametrize("family", FAMILIES)
def test_everything_selected_is_full_training(family, tmp_path):
    """``--train-only '*'`` gives each stage the parameters the shape counts for it: the
    meta model's names go to the stages the trainer's chain cuts."""
    spec = saved(family, tmp_path)
    assert selection_for(spec, None, "*") == replace(Selection.everything(load_shape(spec)),
                                                     given="--train-only '*'")
    assert selection_for(spec, None, None) is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("pick", ["layer 1", "head", "embeddings frozen", "all"])
def test_flops_match_torch_flop_counter(family, pick, tmp_path):
    """Forward + backward of the real model with the selection frozen, under torch's FLOP
    counter (eager attention: full s x s products, ours causal), against ``step_flops``.
    Whole layers train here, so the input gradients are exactly those autograd computes."""
    from transformers import AutoModelForCausalLM

    heads = {"llama": "lm_head.*", "gpt2": "lm_head.weight"}
    embeddings = {"llama": "model.embed_tokens.*", "gpt2": "transformer.w[tp]e.*"}
    freeze, train_only = {"layer 1": (None, layer_glob(family, 1)),
                          "head": (None, heads[family]),
                          "embeddings frozen": (embeddings[family], None),
                          "all": (None, None)}[pick]
    config = hf_config(family, layers=3)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    if pick != "all":
        freeze_parameters(model, freeze, train_only)
    sample = hf_sample(batch=2, seq=16)
    with FlopCounterMode(display=False) as counter:
        model(**sample).loss.backward()
    spec = saved(family, tmp_path)
    shape, step = load_shape(spec), StepShape(seq=16, batch=2)
    sel = selection_for(spec, freeze, train_only) or Selection.everything(shape)
    causal_half = 2.0 * step.batch * step.seq ** 2 * shape.q_width  # one attention's half
    backprop = sum(sel.needs_backward(i) for i in range(1, shape.layers + 1))
    extra = (shape.layers + 2 * backprop) * causal_half
    assert counter.get_total_flops() == pytest.approx(step_flops(shape, step, sel) + extra,
                                                      rel=1e-9)


def test_stage_costs_match_the_profiler_of_the_frozen_model(tmp_path):
    """What the trainer's profiler records of a frozen Llama (trainable and frozen bytes,
    which stages have a backward, which compute their input's gradient) is what the
    analytic costs say, stage by stage."""
    from transformers import AutoModelForCausalLM

    from tierflow.fitting.fit import fit
    config = hf_config("llama", layers=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    train_only = "model.layers.[23].self_attn.*,model.layers.3.mlp.*,model.norm.*"
    freeze_parameters(model, None, train_only)
    ids = torch.randint(0, config.vocab_size, (2, 33))
    measured = fit(model, {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]}).plan.costs
    spec = saved("llama", tmp_path, layers=4)
    analytic = chain_costs(load_shape(spec), StepShape(32, 2), FP32, CPU,
                           selection=selection_for(spec, None, train_only))
    for ours, theirs in zip(analytic.stages, measured.stages, strict=True):
        for field in ("param_bytes", "frozen_bytes", "needs_backward", "input_grad"):
            assert getattr(ours, field) == getattr(theirs, field), (ours.name, field)
    assert [s.needs_backward for s in analytic.stages] == [False] * 3 + [True] * 3


def setup(selection: Selection | None, ram: int | None = None, **kw) -> Setup:
    return Setup(shape=load_shape("llama-134m"), hardware=CPU, seq=512, batch=2, ram=ram,
                 precision=FP32, selection=selection, **kw)


def test_a_fine_tune_of_the_last_layers_is_predicted_smaller_and_faster():
    """Frozen layers take no optimizer states and the ones in front no backward: the peak,
    the step and the states on disk shrink."""
    shape = load_shape("llama-134m")
    sel = selection_for("llama-134m", None, "model.layers.1[01].*,lm_head.*")
    full, tuned = predict(setup(None)), predict(setup(sel))
    assert tuned.trainable == sel.total < 0.5 * shape.total_params() == 0.5 * full.trainable
    assert tuned.step_time < full.step_time
    assert tuned.flops_per_token < full.flops_per_token
    assert tuned.placement.peaks["ram"] < full.placement.peaks["ram"]
    on_disk = [predict(setup(s, ram=int(1.25 * GIB), disk=True, disk_bw=(2e9, 2e9))).placement
               for s in (None, sel)]
    assert on_disk[1].peaks["disk"] < on_disk[0].peaks["disk"]


def test_with_the_head_trainable_its_update_sets_the_smallest_ram():
    """As benchmarks/frozen_budget.py measured: over a disk tier, the smallest RAM of a
    fine-tune of the last layers stays that of full training while the 32000 x 768 head
    trains (its update's states and gradient in RAM at once), and falls once it is frozen."""
    def smallest(train_only: str | None) -> int:
        sel = selection_for("llama-134m", None, train_only) if train_only else None
        disk = setup(sel, ram=2 * GIB, disk=True, disk_bw=(2e9, 2e9))
        return predict(disk).placement.smallest["ram"]

    full = smallest(None)
    assert smallest("model.layers.1[01].*,model.norm.*,lm_head.*") == pytest.approx(full,
                                                                                    rel=0.02)
    assert smallest("model.layers.1[01].*,model.norm.*") < 0.7 * full


def test_the_gpu_planner_prices_states_of_the_trainable_parameters_only():
    """On a GPU profile, frozen weights have no gradient or state anywhere: with every
    optimizer state off the GPU, RAM holds the trainable ones' states alone. (Llama-3.2-1B
    on 8 GiB places them as Llama-3-8B on 24 GiB does, in half the time: 11 s against 24.)"""
    h100 = PUBLISHED["h100-sxm"]
    shape = load_shape("llama3.2-1b")
    sel = selection_for("llama3.2-1b", None, "model.layers.1[45].*,lm_head.*")
    base = dict(shape=shape, hardware=h100, seq=4096, batch=1,
                gpu=8 * 2 ** 30, ram=200 * 2 ** 30)
    full = predict(Setup(**base)).placement
    tuned = predict(Setup(**base, selection=sel)).placement
    assert tuned.peaks["ram"] < full.peaks["ram"]
    per = default_precision(h100).bytes_per_parameter()
    assert full.peaks["ram"] - tuned.peaks["ram"] >= 0.9 * per.optimizer_state * (
        shape.total_params() - sel.total)
    assert full.optimizer.resident == 0


def test_a_pattern_that_matches_nothing_is_the_trainer_error(tmp_path):
    with pytest.raises(TierflowError, match="^--model .*: --freeze pattern 'model.layer.3.*' "
                                            "matches no"):
        selection_for(saved("llama", tmp_path), "model.layer.3.*", None)


def test_plan_names_what_trains_and_refuses_a_typo(capsys):
    code, out, err = run_main("plan", "--model", "llama-134m", "--hardware", "h100-sxm",
                              "--seq-len", "1024", "--train-only", "model.layers.11.*",
                              capsys=capsys)
    assert code == 0, err
    assert "trains" in out and "--train-only 'model.layers.11.*'" in out
    assert "the first 12 stages run forward only" in out  # the embedding and 11 layers
    code, _, err = run_main("plan", "--model", "llama-134m", "--hardware", "h100-sxm",
                            "--seq-len", "1024", "--freeze", "layers.*", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--model llama-134m: --freeze pattern 'layers.*' matches no",
                            "model.embed_tokens.weight"])


def test_plan_refuses_an_empty_pattern_before_the_cpu_profile(monkeypatch, capsys):
    from tierflow.sim import options

    def unreachable(name):
        raise AssertionError(f"the {name} profile was asked for")
    monkeypatch.setattr(options, "hardware", unreachable)
    code, _, err = run_main("plan", "--model", "llama-20m", "--seq-len", "64",
                            "--train-only", ",", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--train-only ','", "empty pattern"])


def test_sweep_writes_the_trainable_parameters(tmp_path, capsys):
    code, _, err = run_main("sweep", "--model", "llama-134m,qwen2.5-0.5b", "--hardware",
                            "h100-sxm", "--seq-len", "1024", "--gpu", "8,16", "--freeze",
                            "model.embed_tokens.*", "-o", str(tmp_path), capsys=capsys)
    assert code == 0, err
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    for model in ("llama-134m", "qwen2.5-0.5b"):
        shape = load_shape(model)
        embedding = shape.vocab * shape.hidden
        assert {int(r["trainable_params"]) for r in rows if r["model"] == model} == {
            shape.total_params() - embedding}
