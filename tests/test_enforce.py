"""``tierflow.exec.enforce``: the files each cgroup version's function writes (on a made-up cgroup
tree, on any machine), and the kernel holding a child process to its limit under the cgroup
version this machine mounts (each test skips, naming why, where that version has no memory
controller or cannot be written)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierflow.exec import enforce

MiB = 1 << 20


def test_limit_counts_what_the_process_holds_above_its_baseline():
    assert enforce.limit_for(100 * MiB, baseline=40 * MiB, rss=70 * MiB) == 70 * MiB
    assert enforce.limit_for(100 * MiB, baseline=40 * MiB, rss=30 * MiB) == 100 * MiB


def test_v2_writes_memory_max_no_swap_and_moves_the_process(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "tierflow-1").mkdir()  # left empty by a process gone: removed
    path = enforce.enter_v2(tmp_path, 300 * MiB, pid=4242)
    assert path == tmp_path / "tierflow-4242" and not (tmp_path / "tierflow-1").exists()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    assert (path / "memory.max").read_text() == str(300 * MiB)
    assert (path / "cgroup.procs").read_text() == "4242"


def test_v1_writes_the_limit_and_moves_the_process(tmp_path):
    path = enforce.enter_v1(tmp_path, 300 * MiB, pid=4242)
    assert (path / "memory.limit_in_bytes").read_text() == str(300 * MiB)
    assert not (path / "memory.memsw.limit_in_bytes").exists()  # no swap accounting here
    assert (path / "cgroup.procs").read_text() == "4242"


def test_no_cgroup_says_why_in_one_line(tmp_path):
    assert "no cgroup v1 memory controller" in enforce.v1_parent(os.getpid(), tmp_path)
    assert "no cgroup v2 is mounted" in enforce.v2_parent(os.getpid(), (tmp_path,))
    with pytest.raises(enforce.EnforceError, match="give a larger budget"):
        enforce.enforce(0)


# a child that enters a cgroup of 64 MiB, fills 16 MiB of page cache (counted, reclaimable)
# and then touches N MiB of fresh anonymous memory
_CHILD = textwrap.dedent("""
    import mmap, os, sys, tempfile
    from tierflow.exec import enforce
    parent = getattr(enforce, sys.argv[1])(os.getpid())
    if isinstance(parent, str):
        print("SKIP", parent, flush=True); sys.exit(0)
    entered = getattr(enforce, sys.argv[2])(parent, 64 << 20, os.getpid())
    memsw = entered / "memory.memsw.limit_in_bytes"
    print("IN", entered, memsw.read_text().strip() if memsw.exists() else "", flush=True)
    with tempfile.TemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        f.write(b"x" * (16 << 20)); f.flush()
    m = mmap.mmap(-1, int(sys.argv[3]) << 20)
    for i in range(0, len(m), 4096):
        m[i] = 1
    print("DONE", flush=True)
""")


def _child(parent_of: str, enter: str, mib: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(enforce.__file__).parents[2])}
    return subprocess.run([sys.executable, "-c", _CHILD, parent_of, enter, str(mib)],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("version", [1, 2])
def test_the_kernel_holds_the_limit(version):
    names = ("v1_parent", "enter_v1") if version == 1 else ("v2_parent", "enter_v2")
    within = _child(*names, 32)
    if within.stdout.startswith("SKIP"):
        pytest.skip(within.stdout.strip())
    if within.returncode != 0 and "IN" not in within.stdout:
        pytest.skip(f"cgroup v{version} refused a child here: {within.stderr.strip()[-200:]}")
    assert within.returncode == 0 and "DONE" in within.stdout, within.stderr
    memsw = within.stdout.split("\n")[0].split()[2:]
    assert memsw in ([], [str(64 << 20)])  # v1: memory and swap together at the limit
    beyond = _child(*names, 128)
    for made in (within, beyond):  # the cgroups of children gone, empty now
        for line in made.stdout.splitlines():
            if line.startswith("IN ") and Path(line.split()[1]).exists():
                Path(line.split()[1]).rmdir()
    assert beyond.returncode == -9 and "DONE" not in beyond.stdout  # killed by the kernel


def _no_cgroup_here() -> str | None:
    """Why neither cgroup version can hold a child here (None: one can)."""
    reasons = [r for r in (enforce.v2_parent(os.getpid()), enforce.v1_parent(os.getpid()))
               if isinstance(r, str)]
    return "; ".join(reasons) if len(reasons) == 2 else None


def fit_enforced() -> None:
    """A fresh process: fit a small model under FitConfig(enforce=True), train two steps in
    the cgroup it entered, and check the limit it wrote."""
    import torch
    from torch import nn

    import tierflow
    from tierflow.exec.memory import rss_bytes
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    x = torch.randn(64, 256)
    budget = 256 * MiB
    outside = rss_bytes() - sum(p.nbytes for p in model.parameters())
    module = tierflow.fit(model, x, ram=budget, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                          config=tierflow.FitConfig(enforce=True))
    line = next(m for m in module.fit_log if m.startswith(enforce.NOTE))
    cgroup = Path(line.split()[8])
    assert cgroup.name == f"tierflow-{os.getpid()}"
    assert str(os.getpid()) in (cgroup / "cgroup.procs").read_text().split()
    key = "memory.max" if "v2" in line else "memory.limit_in_bytes"
    limit = int((cgroup / key).read_text())
    assert 0 < limit <= budget - (rss_bytes() - outside) + 8 * MiB, (limit, line)
    for _ in range(2):
        module(x).square().mean().backward()


def test_fit_enters_a_cgroup_of_the_budget_once_planned():
    why = _no_cgroup_here()
    if why:
        pytest.skip(why)
    from fresh_process import run_in_fresh_process
    run_in_fresh_process("test_enforce", "fit_enforced")


def _train(env: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    from cli_support import fp32_train_args
    src = str(Path(enforce.__file__).parents[2])
    return subprocess.run([sys.executable, "-m", "tierflow", *fp32_train_args(env, out, 2),
                           *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": src})


def test_an_infeasible_budget_under_enforce_is_refused_before_the_step(train_env, tmp_path):
    """In a child: a bug that entered the cgroup first would hold this process to 1 MiB."""
    proc = _train(train_env, tmp_path / "run", "--ram", "1MiB", "--enforce")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("tierflow: error: --ram 1.00 MiB is below"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "[T]" not in proc.stdout


def test_enforce_needs_ram_and_unenforced_ok_needs_enforce(train_env, tmp_path, capsys):
    from cli_support import assert_error_line, fp32_train_args, run_main
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "a", 1, "--enforce"),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--enforce holds the CPU's --ram budget", "give --ram SIZE"])
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "b", 1, "--ram", "1GiB",
                                             "--unenforced-ok"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--unenforced-ok", "give --enforce too"])


def test_train_under_enforce_runs_in_its_cgroup(train_env, tmp_path):
    why = _no_cgroup_here()
    if why:
        pytest.skip(why)
    proc = _train(train_env, tmp_path / "run", "--ram", "1GiB", "--enforce")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[memory cgroup] enforced by the kernel: cgroup v" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("[T] step") == 2


def test_without_a_cgroup_fit_says_why_and_runs_on_only_if_asked(monkeypatch):
    """No cgroup here (both versions' parents refused): an EnforceError naming why, or with
    unenforced_ok a note in fit's log and a module that trains. Nothing moves this process."""
    import torch
    from torch import nn

    import tierflow
    monkeypatch.setattr(enforce, "v2_parent", lambda pid: "no cgroup v2 is mounted (test)")
    monkeypatch.setattr(enforce, "v1_parent", lambda pid: "/x is not writable (test)")
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    with pytest.raises(enforce.EnforceError, match="no cgroup v2 is mounted .test.; /x is not"):
        tierflow.fit(model, x, ram="512MiB", optimizer=sgd,
                     config=tierflow.FitConfig(enforce=True))
    module = tierflow.fit(model, x, ram="512MiB", optimizer=sgd,
                          config=tierflow.FitConfig(enforce=True, unenforced_ok=True))
    assert any(m.startswith(enforce.NOTE) and "running unenforced" in m for m in module.fit_log)
    module(x).sum().backward()
    with pytest.raises(ValueError, match="unenforced_ok=True only matters with enforce=True"):
        tierflow.FitConfig(unenforced_ok=True)


def test_a_budget_the_process_already_holds_is_refused_whatever_unenforced_ok_says():
    """No cgroup can keep it: one line with the value, the limit and the fix, never a note."""
    from tierflow.core.errors import TierflowError
    for unenforced_ok in (False, True):
        with pytest.raises(TierflowError) as err:
            enforce.hold(10 * MiB, baseline=100 * MiB, rss=130 * MiB,
                         unenforced_ok=unenforced_ok, say=print)
        assert not isinstance(err.value, enforce.EnforceError)
        assert str(err.value).startswith("--ram 10.00 MiB cannot be enforced: the process "
                                         "already holds 30.00 MiB"), err.value
        assert "a limit of -20.00 MiB: give --ram above 30.00 MiB" in str(err.value)


# --- tierflow generate --enforce: a Llama whose streaming plan (2 layer buffers, 32 MiB of
# page cache, the runtime) is below its every-weight-in-RAM need (12 layers of 8.6 MiB, fp32)
GENERATE = ("--prompt", "def add", "--max-new-tokens", "4", "--temperature", "0",
            "--dtype", "fp32")


@pytest.fixture(scope="module")
def generate_model(tmp_path_factory):
    import torch
    import transformers

    from tierflow.data.tokenizer import EOT, train_tokenizer
    directory = tmp_path_factory.mktemp("generate") / "model"
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n" * 4, "the quick brown fox " * 8],
                          300)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=384, intermediate_size=1536,
        num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, eos_token_id=tok.token_to_id(EOT), bos_token_id=None,
        pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _generate(model: Path, *extra: str) -> subprocess.CompletedProcess:
    src = str(Path(enforce.__file__).parents[2])
    return subprocess.run([sys.executable, "-m", "tierflow", "generate", "--model", str(model),
                           *GENERATE, *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": src})


def test_generate_refuses_an_infeasible_budget_under_enforce_before_it_runs(generate_model):
    """In a child: a bug that entered the cgroup first would hold this process to 1 MiB."""
    proc = _generate(generate_model, "--ram", "1MiB", "--enforce")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("tierflow: error: --ram 1MiB is too small"), proc.stderr
    assert "give --ram" in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stdout == ""  # not even the prompt


def test_generate_enforce_needs_ram_and_unenforced_ok_needs_enforce(generate_model, capsys):
    from cli_support import assert_error_line, run_main
    code, _, err = run_main("generate", "--model", str(generate_model), *GENERATE,
                            "--enforce", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--enforce holds the CPU's --ram budget", "give --ram SIZE"])
    code, _, err = run_main("generate", "--model", str(generate_model), *GENERATE, "--ram",
                            "1GiB", "--unenforced-ok", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--unenforced-ok", "give --enforce too"])


def generate_enforced(model: str, ram: str) -> None:
    """A fresh process: ``tierflow generate --ram RAM --enforce`` streaming layers, then,
    still in its cgroup, the limit the kernel holds it to and the most it held."""
    import contextlib
    import io

    from tierflow.cli.main import main
    from tierflow.core.units import parse_bytes
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["generate", "--model", model, *GENERATE, "--ram", ram, "--enforce"]) == 0
    assert out.getvalue().startswith("def add") and "[generate] 4 tokens" in out.getvalue()
    lines = err.getvalue().splitlines()
    assert lines[0].startswith(f"{enforce.NOTE} enforced by the kernel: cgroup v"), lines
    assert any("decoder layers are read" in x or "are read from the checkpoint" in x
               for x in lines), lines  # streamed, under the cgroup
    cgroup = Path(lines[0].split()[8])
    assert cgroup.name == f"tierflow-{os.getpid()}"
    assert str(os.getpid()) in (cgroup / "cgroup.procs").read_text().split()
    v2 = "v2" in lines[0]
    limit = int((cgroup / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text())
    budget = parse_bytes(ram)
    assert budget - 64 * MiB < limit <= budget, (limit, lines[0])  # less what it held
    if not v2:  # the most the cgroup held, page cache included: within the limit
        assert 0 < int((cgroup / "memory.max_usage_in_bytes").read_text()) <= limit


def test_generate_under_enforce_streams_in_its_cgroup(generate_model):
    why = _no_cgroup_here()
    if why:
        pytest.skip(why)
    import io

    from fresh_process import run_in_fresh_process

    from tierflow.core.errors import TierflowError
    from tierflow.generate.options import GenerateRequest
    from tierflow.generate.sample import run
    with pytest.raises(TierflowError, match="give --ram") as refused:  # the plan's floor
        run(GenerateRequest.of(generate_model, "def add", max_new_tokens=4, temperature=0,
                               dtype="fp32", ram="1MiB"), out=io.StringIO())
    give = str(refused.value).split("give --ram ")[1].split(" or more")[0].replace(" ", "")
    run_in_fresh_process("test_enforce", "generate_enforced", str(generate_model), give)


def test_generate_without_a_cgroup_says_why_and_runs_on_only_if_asked(generate_model,
                                                                      monkeypatch, capsys):
    """Both versions' parents refused (nothing moves this process): an EnforceError naming
    why, or with unenforced_ok a line on stderr and the text."""
    import io

    from tierflow.generate.options import GenerateRequest
    from tierflow.generate.sample import run
    monkeypatch.setattr(enforce, "v2_parent", lambda pid: "no cgroup v2 is mounted (test)")
    monkeypatch.setattr(enforce, "v1_parent", lambda pid: "/x is not writable (test)")
    request = dict(max_new_tokens=2, temperature=0, dtype="fp32", ram="1GiB", enforce=True)
    with pytest.raises(enforce.EnforceError, match="no cgroup v2 is mounted .test.; /x is not"):
        run(GenerateRequest.of(generate_model, "def add", **request), out=io.StringIO())
    out = io.StringIO()
    run(GenerateRequest.of(generate_model, "def add", unenforced_ok=True, **request), out=out)
    assert "[generate] 2 tokens" in out.getvalue()
    err = capsys.readouterr().err
    assert f"{enforce.NOTE} no memory cgroup can hold this process" in err
    assert "running unenforced" in err
