"""tierflow train: the output, checkpoints that transformers loads, exact resume after kill -9,
one-line errors, the options (TOML merging) and the LR schedule."""
from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import make_train_env, records, run_killed_beside_full, run_main, spy_saved_models

from tierflow.cli.main import build_parser
from tierflow.cli.train import from_args
from tierflow.train.options import TrainOptions
from tierflow.train.schedule import lr_at

SRC = str(Path(__file__).resolve().parents[1] / "src")
T_LINE = re.compile(r"^\[T\] step \d+ \[ ?\d+\.\d%\] \| \d+ ms \| norm \d+\.\d\d \| loss \d+\.\d{3} \| "
                    r"[\d.]+[kM]? tok/s \| sol (\d+\.\d%|-) \| ram \d+\.\d/(\d+\.\d|-) GiB$")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny tokenized corpus (vocab 300) and a tiny Llama saved with save_pretrained."""
    return make_train_env(tmp_path_factory.mktemp("train"))




def train_args(env, out, *extra):
    return ["train", "--model", env["model"], "--data", env["data"], "--seq-len", "32",
            "--batch-size", "2", "--dtype", "fp32", "--lr", "1e-2", "--out", str(out), *extra]



def test_train_prints_logs_and_saves_a_loadable_checkpoint(env, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM
    saved = spy_saved_models(monkeypatch)
    code, out, err = run_main(*train_args(env, tmp_path / "run", "--steps", "4", "--eval-every",
                                          "2", "--eval-steps", "2", "--ram", "1GiB"), capsys=capsys)
    assert code == 0, err
    for title in ("[Options]", "[System]", "[Dataset]", "[Plan]"):
        assert title in out
    for word in ("seq-len", "grad-accum", "recompute", "torch", "threads", "cpu", "bf16",
                 "tokens per step", "parameters", "gradients", "optimizer states",
                 "activations", "margin", "predicted step"):
        assert word in out, word
    t_lines = [line for line in out.splitlines() if line.startswith("[T]")]
    assert len(t_lines) == 4 and all(T_LINE.match(line) for line in t_lines), t_lines
    assert t_lines[0].startswith("[T] step 1 [25.0%]")
    assert len([line for line in out.splitlines() if line.startswith("[V] step")]) == 2
    log = tmp_path / "run" / "log.jsonl"
    kinds = [r["kind"] for r in records(log)]
    assert kinds[:4] == ["options", "system", "dataset", "plan"]
    assert kinds.count("train") == 4 and kinds.count("eval") == 2 and kinds[-1] == "done"
    train = records(log, "train")
    assert all(math.isfinite(r["loss"]) and r["sol"] > 0 for r in train)
    assert train[-1]["tokens"] == 4 * 64

    path = tmp_path / "run" / "step_4"
    assert sorted(p.name for p in path.iterdir()) == [  # the tokenizer travels with its config
        "config.json", "generation_config.json", "model.safetensors", "optimizer.safetensors",
        "tokenizer.json", "tokenizer_config.json", "trainer_state.json"]
    theirs = AutoModelForCausalLM.from_pretrained(path)
    trained = saved[-1]
    trained.eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=tokens).logits, trained(input_ids=tokens).logits)


def _cmd(env, out, *extra):
    return [sys.executable, "-m", "tierflow", "train", "--model", env["model"], "--data",
            env["data"], "--seq-len", "128", "--batch-size", "6", "--dtype", "fp32", "--lr", "1e-2",
            "--warmup", "3", "--steps", "20", "--eval-every", "0", "--out", str(out), *extra]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_an_earlier_peak_of_the_process_does_not_hide_the_runs(env, tmp_path):
    """A process that peaked before calling train (the demo tokenizes first) gets the run's
    own peak RSS above its baseline: before, the baseline was that old peak, and the figure
    stayed 0 until the run passed it. A fresh process of its own: the suite's process holds
    whatever earlier tests left to malloc, which no user's process calling train does."""
    child = (
        "import sys\n"
        "ballast = bytearray(512 * 2**20)\n"
        "ballast[:: 4096] = b'\\1' * len(ballast[:: 4096])  # touch every page: a peak to hide\n"
        "del ballast\n"
        "from tierflow.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    argv = train_args(env, tmp_path / "run", "--steps", "2", "--ram", "1GiB", "--log",
                      str(tmp_path / "log.jsonl"))
    proc = subprocess.run([sys.executable, "-c", child, *argv], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=SRC), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ram = [r["ram_bytes"] for r in records(tmp_path / "log.jsonl", "train")]
    assert len(ram) == 2 and all(0 < b < 256 * 2**20 for b in ram), ram


def test_resume_after_kill_matches_an_uninterrupted_run(env, tmp_path):
    child_env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    child_env.pop("TIERFLOW_TRACEBACK", None)
    run_killed_beside_full(_cmd(env, tmp_path / "full"),
                           _cmd(env, tmp_path / "a", "--save-every", "10"),
                           tmp_path / "a" / "log.jsonl", child_env, timeout=80)

    # the other options (model, data, steps, lr, ...) come from the checkpoint's run
    resumed = subprocess.run([sys.executable, "-m", "tierflow", "train", "--resume",
                              str(tmp_path / "a" / "step_10"), "--log", str(tmp_path / "resumed.jsonl")],
                             capture_output=True, text=True, env=child_env, timeout=80)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    want = {r["step"]: (r["loss"], r["norm"]) for r in records(tmp_path / "full" / "log.jsonl", "train")}
    got = {r["step"]: (r["loss"], r["norm"]) for r in records(tmp_path / "resumed.jsonl", "train")}
    assert sorted(got) == list(range(11, 21))
    assert [got[s] for s in range(11, 21)] == [want[s] for s in range(11, 21)]  # bit for bit
    a = load_state(tmp_path / "a" / "step_20")
    b = load_state(tmp_path / "full" / "step_20")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_saves_and_exits_130(env, tmp_path):
    child_env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_cmd(env, tmp_path / "run", "--steps", "500"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env)
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 60
    while len(records(log, "train")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    step = records(log, "interrupted")[-1]["step"]
    path = tmp_path / "run" / f"step_{step}"
    assert f"interrupted: saved step {step} to {path}; continue with --resume {path}" in out
    assert json.loads((path / "trainer_state.json").read_text())["step"] == step
    assert [r["step"] for r in records(log, "train")][-1] == step


def load_state(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_resume_refuses_a_different_run(env, tmp_path, capsys):
    code, _, err = run_main(*train_args(env, tmp_path / "run", "--steps", "1", "--eval-every", "0"),
                            capsys=capsys)
    assert code == 0, err
    code, _, err = run_main(*train_args(env, tmp_path / "run", "--steps", "2", "--eval-every", "0",
                                        "--seq-len", "16", "--resume", str(tmp_path / "run")),
                            capsys=capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "different run" in lines[0] and "seq_len: checkpoint 32, now 16" in lines[0]
    code, _, err = run_main("train", "--model", "llama-20m", "--resume", str(tmp_path / "run"),
                            "--steps", "2", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "different run (model hidden_size: checkpoint 48, now 256" in err, err
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.bin").write_bytes((Path(env["data"]) / "eval.bin").read_bytes())
    code, _, err = run_main("train", "--data", str(other), "--resume", str(tmp_path / "run"),
                            "--steps", "2", capsys=capsys)
    assert code == 2 and "different run (data" in err and "train_tokens: checkpoint" in err, err
    code, out, err = run_main("train", "--resume", str(tmp_path / "run"), "--steps", "2", capsys=capsys)
    assert code == 0 and "[T] step 2 [100.0%]" in out, err


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(env, tmp_path, capsys):
    code, out, err = run_main(*train_args(env, tmp_path / "run", "--steps", "6", "--save-every", "1",
                                          "--lr", "1e20", "--clip", "0", "--warmup", "0",
                                          "--eval-every", "0"), capsys=capsys)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and re.search(r"loss is (nan|inf) at step (\d+)", line), line
    bad = int(re.search(r"at step (\d+)", line).group(1))
    assert f"last good checkpoint is {tmp_path / 'run' / f'step_{bad - 1}'}" in line
    assert not (tmp_path / "run" / f"step_{bad}").exists()


def test_bad_inputs_are_one_line_exit_2(env, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (["train", "--model", env["model"]], "--data is missing"),
        (["train", "--model", env["model"], "--data", str(empty)], "has no train.bin"),
        (["train", "--model", env["model"], "--data", str(tmp_path / "nope")], "does not exist"),
        (train_args(env, tmp_path / "o", "--seq-len", "256"), "--seq-len 256 is above the model's "
                                                              "maximum positions (128)"),
        (train_args(env, tmp_path / "o", "--lr", "-0.1"), "--lr -0.1 must be positive"),
        (train_args(env, tmp_path / "o", "--lr", "abc"), "'abc' is not a number"),
        (train_args(env, blocker / "run"), f"--out {blocker / 'run'} is not writable"),
        (train_args(env, tmp_path / "o", "--batch-size", "0"), "--batch-size 0 must be at least 1"),
        (train_args(env, tmp_path / "o", "--steps", "2", "--epochs", "1"), "give one of them"),
        (train_args(env, tmp_path / "o", "--ram", "lots"), "--ram 'lots'"),
        (train_args(env, tmp_path / "o", "--ram", "64KiB", "--steps", "1"),
         "--ram 64.00 KiB is below the smallest that works"),
        (train_args(env, tmp_path / "o", "--resume", str(tmp_path / "nope")), "does not exist"),
    ]
    for args, fragment in cases:
        code, _, err = run_main(*args, capsys=capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (args, err)
        assert lines[0].startswith("tierflow: error: ") and fragment in lines[0], (fragment, lines)


def test_a_refused_run_leaves_the_log_of_the_run_before(env, tmp_path, capsys):
    """A run into the directory of an earlier one writes its log beside that run's until it
    has a plan: refused for its budget, it leaves the earlier log as it was (it used to
    truncate it at the start) and no file of its own. A run that plans replaces it."""
    out = tmp_path / "run"
    out.mkdir()
    earlier = '{"kind": "train", "step": 400}\n'
    (out / "log.jsonl").write_text(earlier)
    code, _, err = run_main(*train_args(env, out, "--ram", "64KiB", "--steps", "1"),
                            capsys=capsys)
    assert code == 2, err
    assert (out / "log.jsonl").read_text() == earlier
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]
    code, _, err = run_main(*train_args(env, out, "--steps", "1"), capsys=capsys)
    assert code == 0, err
    assert records(out / "log.jsonl")[0]["kind"] == "options"
    assert not (out / "log.jsonl.new").exists()


def test_preset_takes_the_data_vocab(env, tmp_path, capsys):
    code, out, err = run_main("train", "--model", "llama-20m", "--data", env["data"], "--seq-len",
                              "16", "--batch-size", "1", "--grad-accum", "2", "--epochs", "0.0001",
                              "--eval-every", "0", "--dtype", "fp32", "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 0, err
    assert "vocab           : 300 (model 300)" in out
    steps = [line for line in out.splitlines() if line.startswith("[T]")]
    assert len(steps) == 1  # ceil(0.0001 x train tokens / 32 tokens per step)
    assert "tokens per step : 32 (1 x 2 x 16)" in out
    assert json.loads((tmp_path / "run" / "step_1" / "config.json").read_text())["vocab_size"] == 300


def test_small_model_vocab_is_refused(env, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        tmp_path / "small")
    args = train_args(env, tmp_path / "o")
    args[2] = str(tmp_path / "small")
    code, _, err = run_main(*args, capsys=capsys)
    assert code == 2 and "has vocab size 100" in err and "holds token id 29" in err, err


def test_toml_config_merges_with_flags_winning(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "llama-20m"\ndata = "d"\nseq-len = 128\nbatch_size = 8\nlr = 1\n'
                      'compile = true\nram = "2GiB"\n')
    parser = build_parser()
    opts = from_args(parser.parse_args(["train", "--config", str(config), "--seq-len", "64"]))
    assert (opts.model, opts.data, opts.seq_len, opts.batch_size, opts.lr, opts.compile,
            opts.ram) == ("llama-20m", "d", 64, 8, 1.0, True, "2GiB")
    assert opts.grad_accum == TrainOptions.grad_accum
    config.write_text('model = "m"\ndata = "d"\nseq_len = "long"\n')
    with pytest.raises(ValueError, match="--seq-len 'long' is not a whole number"):
        from_args(parser.parse_args(["train", "--config", str(config)]))
    config.write_text('model = "m"\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        from_args(parser.parse_args(["train", "--config", str(config)]))


def test_progress_bar_only_on_a_terminal(tmp_path):
    from tierflow.train.logger import Logger

    class Stream(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty
    for tty in (False, True):
        out = io.StringIO()
        logger = Logger(tmp_path / f"log{tty}.jsonl", out=out)
        logger.bar_stream = bar = Stream(tty)
        logger.tty = bar.isatty()
        logger.bar(5, 10, 0.5)
        logger.print("[T] step 6")
        logger.record("train", step=6, loss=1.5)
        logger.keep()
        logger.close()
        assert ("5/10 eta 2 s" in bar.getvalue()) == tty
        assert out.getvalue() == "[T] step 6\n"
        assert records(tmp_path / f"log{tty}.jsonl")[0]["loss"] == 1.5


def test_a_resumed_run_removes_the_log_of_a_run_killed_before_its_plan(tmp_path):
    """A run killed before it had its plan (SIGKILL: no close) leaves its log.jsonl.new; the
    next new run would overwrite it, and a resumed run, which appends to log.jsonl, removes it."""
    from tierflow.train.logger import Logger

    log = tmp_path / "log.jsonl"
    log.write_text('{"kind": "train", "step": 400}\n')
    killed = Logger(log, out=io.StringIO())
    killed.record("options", steps=1)
    killed.file.close()  # as a SIGKILL leaves it: neither kept nor removed
    assert (tmp_path / "log.jsonl.new").exists()
    resumed = Logger(log, out=io.StringIO(), append=True)
    resumed.record("resume", step=400)
    resumed.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]
    assert [r["kind"] for r in records(log)] == ["train", "resume"]


def test_schedule_warmup_then_cosine():
    kw = dict(lr=1.0, warmup=4, total=14, min_lr=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0 and lr_at(13, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(4, 14)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert lr_at(0, lr=1.0, warmup=0, total=1, min_lr=0.0) == 1.0


def test_the_plan_table_lists_every_kind_on_the_disk_tier():
    """Optimizer states, streamed weights, offloaded tapes and stashed checkpoints each have
    a share of the disk tier in the [Plan] table and in its JSON record."""
    from tierflow.core.config import FitConfig
    from tierflow.plan.choose import make_plan
    from tierflow.plan.costs import ChainCosts, StageCost
    from tierflow.precision.config import PrecisionConfig
    from tierflow.train.logger import PlanPrecision, plan_section

    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    extra = {"optimizer states on disk": 800, "weights tier": "disk", "streamed bytes": 200,
             "streamed stages": [0, 1], "tapes tier": "disk", "offloaded tape bytes": 60,
             "offloaded tapes": [0, 1], "prefetch depth": 1, "boundaries tier": "disk"}
    costs = ChainCosts(stages=(stage, stage, stage), input_bytes=10, stashable=(1,),
                       extra=extra)
    plan = make_plan(costs, None, FitConfig(planner="checkpoint-all"))
    config = PrecisionConfig()
    precision = PlanPrecision(config.bytes_per_parameter(), 50, 0, config.to_dict())
    text, record = plan_section(plan, grads=200, budget=None, grad_accum=1, dist=None,
                                precision=precision)
    assert record["disk_bytes"] == {"optimizer states": 800,
                                    "weights of 2 streamed stages": 200,
                                    "tapes of 2 stages": 60, "1 checkpoint": 10}
    assert "60 B tapes of 2 stages + 10 B 1 checkpoint;" in text, text


def test_the_plan_table_says_what_host_steps_hold_in_ram():
    """Below a GPU, the [Plan]'s ram-tier line names what AdamW's steps there hold: the
    states' and the weights' reads from disk only when the plan makes them."""
    from tierflow.core.config import FitConfig
    from tierflow.plan.choose import make_plan
    from tierflow.plan.costs import ChainCosts, StageCost
    from tierflow.precision.config import PrecisionConfig
    from tierflow.train.logger import PlanPrecision, plan_section

    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    config = PrecisionConfig()
    precision = PlanPrecision(config.bytes_per_parameter(), 50, 0, config.to_dict())

    def ram_line(**extra) -> str:
        costs = ChainCosts(stages=(stage, stage), input_bytes=10,
                           extra={"host step bytes": 300, **extra})
        text, _ = plan_section(make_plan(costs, None, FitConfig(planner="keep-all")),
                               grads=200, budget=None, grad_accum=1, dist=None,
                               precision=precision)
        return next(line for line in text.splitlines() if "ram tier" in line)

    assert "300 B for AdamW's steps there (gradients, temporaries);" in ram_line()
    assert "(gradients, temporaries, states read from disk);" in ram_line(
        **{"optimizer states on disk": 800})
    assert "(gradients, temporaries, states read from disk, weights read from disk);" in \
        ram_line(**{"optimizer states on disk": 800, "host steps read weights": True})


def test_the_plan_table_counts_the_update_pass():
    """With updates after the backward (clipping, accumulation) the [Plan] table's step time
    includes the pass and its peak is the larger of the plan's and the pass's."""
    from tierflow.core.config import FitConfig
    from tierflow.plan.choose import make_plan
    from tierflow.plan.costs import ChainCosts, StageCost
    from tierflow.plan.tier_costs import UpdatePass
    from tierflow.precision.config import PrecisionConfig
    from tierflow.train.logger import PlanPrecision, plan_section

    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    plan = make_plan(ChainCosts(stages=(stage, stage), input_bytes=10, optimizer_owned=True),
                     None, FitConfig(planner="keep-all"))
    config = PrecisionConfig()
    precision = PlanPrecision(config.bytes_per_parameter(), 50, 0, config.to_dict())
    passed = UpdatePass(seconds=0.5, peak=plan.predicted_peak + 1000)
    text, record = plan_section(plan, grads=200, budget=None, grad_accum=2, dist=None,
                                precision=precision, update_pass=passed)
    assert record["predicted_peak"] == passed.peak
    assert record["predicted_step_s"] == pytest.approx(2 * plan.predicted_time + 0.5)
    assert "update pass" in text and "+ 500 ms update pass" in text, text
    _, inside = plan_section(plan, grads=200, budget=None, grad_accum=1, dist=None,
                             precision=precision)
    assert inside["predicted_peak"] == plan.predicted_peak


def test_the_plan_table_counts_the_optimizer_step_and_what_is_held_outside_the_plan():
    """The [Plan] table lists the optimizer step's temporaries apart from its states (both are
    reserved), and its margin is the budget less the peak and less what the process held
    before planning (the plan got only the rest)."""
    from tierflow.core.config import FitConfig
    from tierflow.core.units import format_margin
    from tierflow.plan.choose import make_plan
    from tierflow.plan.costs import ChainCosts, StageCost
    from tierflow.precision.config import PrecisionConfig
    from tierflow.train.logger import PlanPrecision, plan_section

    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    costs = ChainCosts(stages=(stage, stage), input_bytes=10, static_bytes=1400,
                       extra={"parameters": 200, "reserved": 1200})
    plan = make_plan(costs, 4000, FitConfig(planner="keep-all"))  # 1000 of 5000 held outside
    config = PrecisionConfig()
    precision = PlanPrecision(config.bytes_per_parameter(), 50, 0, config.to_dict())
    text, record = plan_section(plan, grads=200, budget=5000, grad_accum=1, dist=None,
                                precision=precision, step_temporaries=400)
    assert record["optimizer states (reserved)"] == record["moments"] == 800
    assert record["optimizer step (reserved)"] == 400
    free = format_margin(plan.predicted_peak + 1000, 5000)
    assert f"margin                      : {free} between the predicted peak and the budget " \
           "(1000 B is held outside the plan)" in text, text
    assert "optimizer step              : 400 B (float32 temporaries" in text, text
