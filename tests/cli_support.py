"""Running the command line in-process from tests, what its user errors must look like, and
the tiny training environment (corpus, token files, model) trainer tests share."""
import io
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import torch

from tierflow.cli.main import main

STDLIB_FILES = ("textwrap.py", "bisect.py", "colorsys.py", "keyword.py", "heapq.py", "abc.py",
                "fnmatch.py", "glob.py")


def make_train_env(root: Path, names: tuple[str, ...] = STDLIB_FILES) -> dict:
    """A tiny tokenized corpus (the stdlib modules ``names``, vocab 300) and a tiny Llama
    saved with save_pretrained under ``root``: {"root", "data", "model"}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierflow.data.tokenize import tokenize
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(os.__file__).parent
    for i, name in enumerate(names):
        (corpus / f"doc{i}.txt").write_text((stdlib / name).read_text())
    tokenize([str(corpus)], root / "data", vocab_size=300, eval_fraction=0.2, log=io.StringIO())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=304, hidden_size=48, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128)
        LlamaForCausalLM(config).save_pretrained(root / "model")
    return {"root": root, "data": str(root / "data"), "model": str(root / "model")}


def fp32_train_args(env: dict, out: Path, steps: int, *extra: str) -> list[str]:
    """``tierflow train`` of the tiny model on the tiny corpus, fp32, no warmup or eval: the
    runs that compare placements (or devices) loss for loss."""
    return ["train", "--model", env["model"], "--data", env["data"], "--seq-len", "32",
            "--batch-size", "2", "--dtype", "fp32", "--lr", "1e-2", "--warmup", "0",
            "--eval-every", "0", "--steps", str(steps), "--out", str(out), *extra]


def train_losses(out: Path) -> list[float]:
    """The losses of a run's ``[T]`` records, from its ``out/log.jsonl``."""
    return [r["loss"] for r in records(out / "log.jsonl", "train")]


def train_like_the_cpu_and_resume(env: dict, root: Path, flags: tuple[str, ...], capsys,
                                  rtol: float) -> str:
    """4 steps of the tiny model on the CPU (``root``/cpu) and with ``flags`` (``root``/run,
    a checkpoint at step 2): the losses equal within ``rtol``; then a run resumed from that
    checkpoint with ``flags`` continues with the uninterrupted run's losses, bit for bit.
    Returns what the run with ``flags`` printed."""
    code, _, err = run_main(*fp32_train_args(env, root / "cpu", 4), capsys=capsys)
    assert code == 0, err
    code, out, err = run_main(*fp32_train_args(env, root / "run", 4, "--save-every", "2",
                                               *flags), capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(root / "run"), train_losses(root / "cpu"),
                               rtol=rtol, atol=0.0)
    code, _, err = run_main("train", "--resume", str(root / "run" / "step_2"), "--out",
                            str(root / "resumed"), *flags, capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(root / "resumed"), train_losses(root / "run")[2:],
                               rtol=0.0, atol=0.0)
    return out


def spy_saved_models(monkeypatch) -> list:
    """The models the trainer passes to ``save_checkpoint``, in order (the saving goes on)."""
    from tierflow.train import checkpoint as ckpt_module
    saved = []
    original = ckpt_module.save_checkpoint

    def spy(out_dir, step, model, **kw):
        saved.append(model)
        return original(out_dir, step, model, **kw)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", spy)
    return saved


def run_main(*args, capsys):
    """(exit code, stdout, stderr) of ``tierflow ARGS``."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_error_line(err: str, fragments) -> None:
    """A user error: one ``tierflow: error:`` line holding every fragment."""
    assert len(err.strip().splitlines()) == 1 and err.startswith("tierflow: error: "), err
    assert all(f in err for f in fragments), err


def records(path: Path, kind: str | None = None) -> list[dict]:
    """The JSONL log's records (of one ``kind``), skipping a line being written."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if kind is None or r["kind"] == kind:
            out.append(r)
    return out


def run_killed_beside_full(full_cmd: list[str], killed_cmd: list[str], log: Path, env: dict,
                           timeout: float) -> None:
    """Start an uninterrupted run and a second one; kill -9 the second just after its
    step-10 checkpoint is in ``log``; wait for the first to finish."""
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    full = subprocess.Popen(full_cmd, **quiet)
    killed = subprocess.Popen(killed_cmd, **quiet)
    deadline = time.monotonic() + timeout
    while not any(r["step"] == 10 for r in records(log, "checkpoint")):
        assert killed.poll() is None, killed.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.2))
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert full.wait(timeout=timeout) == 0, full.stderr.read().decode()
