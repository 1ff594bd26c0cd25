"""Bad input to ``tierflow train`` (and ``tokenize``) through the real command line (its
``main``; one case as ``python -m tierflow`` too, and the checks made before torch is
imported in processes where torch cannot be): one line ``tierflow: error: ...`` naming the
value and the fix, exit code 2, no traceback, nothing half-written. A full disk while
checkpointing is made by failing the checkpoint writer (the product has no hook for it)."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierflow.cli.main import main
from tierflow.data.tokenfile import write_tokens
from tierflow.train import checkpoint as ckpt_module

SRC = str(Path(__file__).resolve().parents[1] / "src")
VOCAB = 96


def _tiny_llama(vocab=VOCAB, positions=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=positions))


def _run_main(*args):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _base(root: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(root / "model"), "--data", str(root / "data"), "--seq-len",
            "16", "--batch-size", "2", "--dtype", "fp32", "--eval-every", "0", "--steps", "2",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Token files (vocab 96), a tiny Llama (64 positions), a finished run with step_1 and
    step_2, and one damaged copy of each input for the cases below."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("errors")
    os.environ.setdefault("TIERFLOW_CACHE", str(root / "cache"))
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, 3000)
    tokens[10] = VOCAB - 1
    write_tokens(data / "train.bin", tokens, VOCAB)
    write_tokens(data / "eval.bin", rng.integers(0, VOCAB, 500), VOCAB)
    _tiny_llama().save_pretrained(root / "model")
    _tiny_llama(vocab=64).save_pretrained(root / "small-vocab")
    poisoned = _tiny_llama()
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[:, 0] = float("inf")
    poisoned.save_pretrained(root / "poisoned")
    (root / "no-weights").mkdir()
    shutil.copy(root / "model" / "config.json", root / "no-weights" / "config.json")

    def damaged(name: str, change) -> None:
        copy = root / name
        shutil.copytree(data, copy)
        raw = bytearray((copy / "train.bin").read_bytes())
        (copy / "train.bin").write_bytes(bytes(change(raw)))

    def patch(offset, value):
        def change(raw):
            raw[offset:offset + len(value)] = value
            return raw
        return change
    damaged("bad-magic", patch(0, b"NOTTOKEN"))
    damaged("bad-version", patch(8, struct.pack("<I", 9)))
    damaged("truncated", lambda raw: raw[:-3])
    damaged("small-header-vocab", patch(24, struct.pack("<Q", 50)))
    (root / "no-train").mkdir()
    (root / "empty-corpus").mkdir()
    (root / "a-file").write_text("x")

    code, _, err = _run_main(*_base(root, root / "run", "--save-every", "1"))
    assert code == 0, err
    assert (root / "run" / "step_1").is_dir() and (root / "run" / "step_2").is_dir()
    shutil.copytree(root / "run" / "step_2", root / "corrupt" / "step_2")
    with open(root / "corrupt" / "step_2" / "model.safetensors", "r+b") as f:
        f.truncate(20)  # the 8-byte length and the start of the JSON header
    torch.set_num_threads(threads)
    return root


def _cases(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (arguments, fragments the error line holds). {out} is a fresh directory."""
    out = "{out}"
    b = lambda *extra: _base(root, Path(out), *extra)  # noqa: E731

    def with_data(name):
        args = b()
        args[args.index("--data") + 1] = str(root / name)
        return args

    def with_model(name):
        args = b()
        args[args.index("--model") + 1] = str(root / name)
        return args
    return {
        "model missing": (with_model("nope"), [f"model '{root / 'nope'}'", "neither a preset",
                                               "pass a preset name"]),
        "model without weights": (with_model("no-weights"), ["no weights in", "save_pretrained"]),
        "data missing": (with_data("nope"), [f"--data {root / 'nope'} does not exist",
                                             "tierflow tokenize"]),
        "data is a file": (with_data("a-file"), [f"--data {root / 'a-file'} is a file"]),
        "no train.bin": (with_data("no-train"), ["has no train.bin", "tierflow tokenize"]),
        "wrong magic": (with_data("bad-magic"), ["wrong magic b'NOTTOKEN'", "tierflow tokenize"]),
        "wrong version": (with_data("bad-version"), ["format version 9", "reads versions 1, 2",
                                                     "tierflow tokenize"]),
        "truncated token file": (with_data("truncated"), ["is truncated", "promises 3000 tokens",
                                                          "tierflow tokenize"]),
        "token id above the file's vocab": (with_data("small-header-vocab"),
                                            ["token id 95", "vocab size is 50", "tokenize again"]),
        "token id above the model's vocab": (with_model("small-vocab"),
                                             ["holds token id 95", "vocab size 64",
                                              "at least 96 ids"]),
        "seq-len above positions": (b("--seq-len", "100"),
                                    ["--seq-len 100 is above the model's maximum positions (64)",
                                     "use --seq-len 64 or less"]),
        "non-numeric steps": (b("--steps", "many"), ["--steps", "'many' is not a whole number"]),
        "non-numeric lr": (b("--lr", "fast"), ["--lr", "'fast' is not a number"]),
        "negative steps": (b("--steps", "-3"), ["--steps -3 must be at least 1"]),
        "negative lr": (b("--lr=-1e-3"), ["--lr -0.001 must be positive", "3e-4"]),
        "negative weight decay": (b("--weight-decay", "-1"), ["--weight-decay -1.0 must be at "
                                                              "least 0"]),
        "negative seq-len": (b("--seq-len", "-16"), ["--seq-len -16 must be at least 1"]),
        "negative ram": (b("--ram=-1GiB"), ["--ram '-1GiB'"]),
        "infeasible ram": (b("--ram", "100KiB"), ["100", "smallest"]),
        "unwritable out": (_base(root, root / "a-file" / "run"),
                           [f"--out {root / 'a-file' / 'run'} is not writable",
                            "choose a directory"]),
        "resume a different run": (b("--resume", str(root / "run" / "step_2"), "--seq-len", "8"),
                                   ["different run", "seq_len: checkpoint 16, now 8",
                                    "start a new run from it without --resume"]),
        "resume a corrupt header": (b("--resume", str(root / "corrupt" / "step_2")),
                                    [f"{root / 'corrupt' / 'step_2' / 'model.safetensors'} is "
                                     "not a readable safetensors file"]),
        "resume a missing checkpoint": (b("--resume", str(root / "nope")),
                                        [f"checkpoint {root / 'nope'} does not exist"]),
        "non-finite weights": (with_model("poisoned"),
                               [f"the weights of {root / 'poisoned'} hold inf or nan in "
                                "model.embed_tokens.weight (96 values)", "every loss would be "
                                "nan", "use a checkpoint saved before"]),
        "empty corpus": (["tokenize", str(root / "empty-corpus"), "--out", out],
                         ["corpus is empty"]),
        "tokenize missing input": (["tokenize", str(root / "nope.txt"), "--out", out],
                                   [f"{root / 'nope.txt'} does not exist"]),
    }


CASES = list(_cases(Path("/r")))


# the case that runs as `python -m tierflow ...` in a process of its own (the entry point's
# exit code and stderr after a refusal that comes late, once the step is profiled; 8 s of
# imports and work where main takes a second): the others run in this one, and the checks
# before torch is imported run in processes of their own below, torch-less
OWN_PROCESS = ("infeasible ram",)


@dataclasses.dataclass
class Ran:
    """What a case's run left: its exit code, stdout and stderr."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def results(root):
    """Every case run, those of OWN_PROCESS as `python -m tierflow ...`, the others through
    ``main`` in this process."""
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1",
               TIERFLOW_CACHE=str(root / "cache"))
    env.pop("TIERFLOW_TRACEBACK", None)
    cases = _cases(root)

    def args_of(name):
        out = root / "outs" / name.replace(" ", "-")
        return [a.replace("{out}", str(out)) for a in cases[name][0]], out

    def own_process(name):
        args, out = args_of(name)
        proc = subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                              text=True, env=env, timeout=300)
        return name, (Ran(proc.returncode, proc.stdout, proc.stderr), cases[name][1], out)
    ran = dict(map(own_process, OWN_PROCESS))
    for name in cases.keys() - set(OWN_PROCESS):
        args, out = args_of(name)
        ran[name] = (Ran(*_run_main(*args)), cases[name][1], out)
    return ran


@pytest.mark.parametrize("name", CASES)
def test_one_line_exit_2_and_nothing_half_written(results, name):
    proc, fragments, out = results[name]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (name, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("tierflow: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    if out.exists():  # no checkpoint, no temporary directory, no half-written token file
        left = sorted(p.name for p in out.iterdir())
        assert all(n == "log.jsonl" for n in left), left


def test_the_ram_an_infeasible_budget_names_works(results, root, tmp_path):
    """What a user does next: run again with the --ram the refusal gives (measured sizes vary
    between runs; the figure leaves room for that)."""
    proc, _, _ = results["infeasible ram"]
    given = re.search(r"give --ram (\d+MiB) or more", proc.stderr)
    assert given, proc.stderr
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1",
               TIERFLOW_CACHE=str(root / "cache"))
    again = subprocess.run([sys.executable, "-m", "tierflow",
                            *_base(root, tmp_path / "run", "--ram", given[1])],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr


_TORCH_BLOCKED = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError(name + ' imported before the bad input was found')
sys.meta_path.insert(0, Blocked())
from tierflow.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("case", ["model missing", "model without weights", "data missing",
                                  "no train.bin", "wrong magic", "negative lr", "negative ram",
                                  "unwritable out", "non-numeric steps", "seq-len above positions",
                                  "token id above the model's vocab",
                                  "resume a missing checkpoint"])
def test_cheap_bad_input_fails_before_torch_is_imported(root, tmp_path, case):
    """Flags, --model's path, config.json and weight files, --data (against the vocab and
    positions config.json states), the output directory and --resume's directory are checked
    before torch and transformers are imported (2-4 s here): the same one-line error with
    both unimportable."""
    args, fragments = _cases(root)[case]
    args = [a.replace("{out}", str(tmp_path / "out")) for a in args]
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-c", _TORCH_BLOCKED, *args], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tierflow: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr
    assert not (tmp_path / "out").exists()  # the checks create nothing


def test_a_bad_disk_directory_fails_before_torch_is_imported(root, tmp_path):
    args = _base(root, tmp_path / "out", "--disk", str(tmp_path / "nope"))
    proc = subprocess.run([sys.executable, "-c", _TORCH_BLOCKED, *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"disk directory {tmp_path / 'nope'} does not exist" in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--model", "{tmp}/nope", "--prompt", "x"], "--model {tmp}/nope does not exist"),
    (["--model", "{tmp}/bare", "--prompt", "x"], "no config.json in {tmp}/bare"),
    (["--model", "{tmp}/config", "--prompt", "x"], "no weights in {tmp}/config"),
    (["--model", "{tmp}/weights", "--prompt", "x"], "no tokenizer.json in {tmp}/weights"),
    (["--model", "{tmp}/weights", "--prompt", "x", "--tokenizer", "{tmp}/t.json"],
     "--tokenizer {tmp}/t.json does not exist"),
    (["--model", "{tmp}/weights", "--prompt", "x", "--tokenizer", "{tmp}/bare"],
     "--tokenizer {tmp}/bare has no tokenizer.json"),
    (["--model", "{tmp}/ready", "--prompt", ""], "the prompt is empty"),
    (["--model", "{tmp}/ready", "--prompt", "x", "--ram", "lots"], "--ram 'lots'")])
def test_bad_generate_input_fails_before_torch_is_imported(tmp_path, args, fragment):
    """Model directories holding nothing (bare), a config.json, a config.json and (empty,
    unread) weights, and those with a tokenizer.json (ready)."""
    for name, files in {"bare": (), "config": ("config.json",),
                        "weights": ("config.json", "model.safetensors"),
                        "ready": ("config.json", "model.safetensors", "tokenizer.json")}.items():
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("{}")
    args = ["generate", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    proc = subprocess.run([sys.executable, "-c", _TORCH_BLOCKED, *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert fragment.replace("{tmp}", str(tmp_path)) in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_previous_checkpoints_untouched(results, root):
    """The failed resumes above left the run they read as it was."""
    from tierflow import load_model
    from tierflow.train.checkpoint import load_checkpoint
    assert load_checkpoint(root / "run").step == 2
    load_model(root / "run" / "step_2")
    assert sorted(p.name for p in (root / "run").iterdir()) == ["log.jsonl", "step_1", "step_2"]


def test_unreadable_token_file(root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    (data / "train.bin").chmod(0)
    if os.access(data / "train.bin", os.R_OK):
        pytest.skip("running as a user who reads any file (root)")
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    args = _base(root, tmp_path / "out")
    args[args.index("--data") + 1] = str(data)
    proc = subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{data / 'train.bin'} is not readable" in proc.stderr


def test_permission_errors_are_one_line(root, tmp_path, monkeypatch):
    """A file the user may not read (simulated: root reads everything) is one line naming it."""
    from tierflow.models import load as load_module
    original = load_module.read_config

    def denied(directory):
        raise PermissionError(errno.EACCES, "Permission denied", str(directory / "config.json"))
    monkeypatch.setattr(load_module, "read_config", denied)
    code, _, err = _run_main(*_base(root, tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"cannot read {root / 'model' / 'config.json'} (permission denied)" in lines[0]
    monkeypatch.setattr(load_module, "read_config", original)


def test_full_disk_while_checkpointing_keeps_the_previous_one(root, tmp_path, monkeypatch):
    """Steps 1-4 with --save-every 1: the disk fills while step 3 is being saved. Step 2's
    checkpoint stays byte for byte, the error is one line, nothing of step 3 is left."""
    monkeypatch.setenv("TIERFLOW_CACHE", str(root / "cache"))
    out = tmp_path / "run"
    original_save = ckpt_module.save_checkpoint
    original_write = ckpt_module._write
    snapshot = {}
    written = {"bytes": 0}

    def full(f, data):
        written["bytes"] += len(data)
        if written["bytes"] > 5000:  # part of the weights went out, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        original_write(f, data)

    def save(out_dir, step, model, **kw):
        if step == 3:
            monkeypatch.setattr(ckpt_module, "_write", full)
        path = original_save(out_dir, step, model, **kw)
        if step == 2:
            snapshot.update({p.name: p.read_bytes() for p in path.iterdir()})
        return path
    monkeypatch.setattr(ckpt_module, "save_checkpoint", save)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, stdout, err = _run_main(*_base(root, out, "--steps", "4", "--save-every", "1"))
    finally:
        torch.set_num_threads(threads)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == (f"tierflow: error: no space left on device writing checkpoint to "
                        f"{out / 'step_3'}: free space or use --out elsewhere; the previous "
                        "checkpoint step_2 is intact")
    assert written["bytes"] > 5000 and "[T] step 3" in stdout and "[T] step 4" not in stdout
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl", "step_1", "step_2"]
    assert {p.name: p.read_bytes() for p in (out / "step_2").iterdir()} == snapshot
    monkeypatch.setattr(ckpt_module, "_write", original_write)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", original_save)
    from tierflow.train.checkpoint import load_checkpoint
    assert load_checkpoint(out).step == 2
    # and the run continues from it once there is space again
    code, stdout, err = _run_main("train", "--resume", str(out), "--steps", "4")
    assert code == 0, err
    assert "resumed from" in stdout and (out / "step_4").is_dir()


def test_nan_keeps_the_last_good_checkpoint_through_the_cli(root, tmp_path):
    """An infinite learning rate blows up after a checkpoint: the error names the step and the
    checkpoint, which still loads; nothing was saved for the bad step."""
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", TIERFLOW_CACHE=str(root / "cache"))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tierflow",
                           *_base(root, out, "--steps", "6", "--save-every", "1", "--lr", "1e30",
                                  "--clip", "0", "--warmup", "0")],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    import re
    m = re.search(r"the (loss|gradient norm) is (nan|inf|-inf) at step (\d+)", lines[0])
    assert m, lines[0]
    bad = int(m.group(3))
    good = out / f"step_{bad - 1}"
    assert f"the last good checkpoint is {good}" in lines[0] if bad > 1 else "none" in lines[0]
    assert not (out / f"step_{bad}").exists()
    errors = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()
              if json.loads(r)["kind"] == "error"]
    assert errors and errors[-1]["step"] == bad
    if bad > 1:
        from tierflow.train.checkpoint import load_checkpoint
        assert load_checkpoint(out).path == good


# ---------------------------------------------------------------- generate --ram

@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    """A tiny tied Qwen2 (GQA: 2 kv heads of 4) with a tokenizer.json beside it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tierflow.data.tokenizer import train_tokenizer
    directory = tmp_path_factory.mktemp("gen") / "model"
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n" * 3, "hello world " * 5], 300)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=128)).save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return directory, tok


def test_generate_memory_need_is_weights_kv_cache_and_a_margin(gen_dir):
    from tierflow import load_model
    from tierflow.generate.memory import memory_needed
    directory, tok = gen_dir
    model = load_model(directory)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert len(unique) < len(list(model.named_parameters(remove_duplicate=False)))  # tied
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        need = memory_needed(directory, dtype, 5, 20)
        assert need.weights == sum(unique.values()) * size
        assert need.kv_cache == 2 * 3 * 2 * 8 * (5 + 20) * size
        vocab = model.config.vocab_size
        assert need.activations == 5 * vocab * 4 + 5 * (4 * 32 + 2 * 64) * size + 4 * 25 * 4
        assert need.total == need.weights + need.kv_cache + need.activations


def test_generate_ram_refuses_below_the_need_and_runs_at_it(gen_dir, tmp_path):
    from tierflow.data.tokenizer import load_tokenizer
    from tierflow.generate.memory import memory_needed
    directory, _ = gen_dir
    tok = load_tokenizer(directory / "tokenizer.json")
    prompt = "def add"
    from tierflow.generate.memory import RUNTIME_BYTES
    need = memory_needed(directory, torch.float32, len(tok.encode(prompt).ids), 16).total \
        + RUNTIME_BYTES
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "tierflow", "generate", "--model", str(directory), "--prompt",
            prompt, "--max-new-tokens", "16", "--dtype", "fp32", "--temperature", "0"]
    low = subprocess.run([*base, "--ram", f"{need - 1}B"], capture_output=True, text=True,
                         env=env, timeout=300)
    lines = low.stderr.strip().splitlines()
    assert low.returncode == 2 and len(lines) == 1 and not low.stdout, low.stderr
    assert lines[0].startswith(f"tierflow: error: --ram {need - 1}B is too small to generate 16 "
                               "tokens after a"), lines[0]
    for fragment in ("weights", "KV cache", "activations", "every weight in RAM",
                     "streaming every decoder layer needs"):
        assert fragment in lines[0]
    import re
    smallest = re.search(r"give --ram (\S+ \S+|\d+ B) or more", lines[0]).group(1)
    from tierflow.core.units import parse_bytes
    assert need <= parse_bytes(smallest.replace(" ", "")) <= need * 1.01 + 1
    ok = subprocess.run([*base, "--ram", smallest.replace(" ", "")], capture_output=True,
                        text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(prompt) and "[generate] " in ok.stdout
    bad = subprocess.run([*base, "--ram", "lots"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert bad.returncode == 2 and "--ram 'lots'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
