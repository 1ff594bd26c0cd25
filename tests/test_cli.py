"""The command line: user errors are one line with exit code 2; `tierflow compare` runs end to
end. Also the measurement helpers compare and the benchmarks share (tierflow.cli.measure)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import assert_error_line

from tierflow.cli import compare, measure
from tierflow.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TIERFLOW_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tierflow: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragments", [
    (["compare", "--ram", "lots"], ["--ram", "'lots'", "GiB"]),
    (["compare", "--ram", "0"], ["--ram", "positive"]),
    (["compare", "--bogus"], ["--bogus"]),
    (["compare", "--steps", "0"], ["--steps"]),
    (["demo", "--ram", "lots"], ["--ram", "'lots'", "GiB"]),
    (["demo", "--steps", "0"], ["--steps"]),
    ([], ["COMMAND"]),
    (["frobnicate"], ["frobnicate"]),
])
def test_user_errors_are_one_line_exit_2(args, fragments, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert_error_line(err, fragments)


def test_bad_ram_from_python_dash_m():
    assert_one_line_error(run_cli("compare", "--ram", "lots"), "--ram", "'lots'")


def test_tierflow_value_error_is_one_line(monkeypatch, capsys):
    from tierflow.core.errors import BudgetError

    def infeasible(args):
        raise BudgetError("ram budget 1.00 MiB is too small:\nthe smallest plan needs 9.00 MiB",
                          tier="ram", budget=2**20, smallest=9 * 2**20)
    monkeypatch.setattr(compare, "run", infeasible)
    with pytest.raises(SystemExit) as exc:
        main(["compare"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "tierflow: error: ram budget 1.00 MiB is too small: the smallest plan needs 9.00 MiB\n"


def test_bugs_keep_their_traceback(monkeypatch):
    def bug(args):
        raise ValueError("not tierflow's")  # raised here, in a test file: a bug, not a user error
    monkeypatch.setattr(compare, "run", bug)
    with pytest.raises(ValueError, match="not tierflow's"):
        main(["compare"])


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tierflow "), proc


def test_comparison_table():
    plain = {"peak_above_baseline_bytes": 2 * 2**30, "step_s_median": 1.0, "tok_s": 2048.0,
             "losses": [10.5, 10.4]}
    fitted = {"peak_above_baseline_bytes": 2**30, "step_s_median": 1.2, "tok_s": 1706.7,
              "losses": [10.5, 10.4], "predicted_peak_bytes": int(1.1 * 2**30),
              "predicted_step_s": 1.1, "fit_s": 3.0}
    text = compare.comparison_table(plain, fitted, budget=2**30)
    assert "plain PyTorch" in text and "tierflow" in text
    assert "100.0% of the 1.00 GiB budget" in text
    assert "+10.0% vs measured" in text
    assert "margin -102.40 MiB (-10.0% of the 1.00 GiB budget)" in text  # the peak passes it
    assert "50% less memory" in text and "1.20x" in text


def test_workload_params_match_transformers():
    pytest.importorskip("transformers")
    for arch in ("llama-tiny", "llama-20m"):
        model = measure.build(arch, 128)
        assert measure.Workload(arch=arch).params() == sum(p.numel() for p in model.parameters())


# a child that measures its baseline, then touches 100 MiB more and measures its peak
_CHILD_PEAK = ("import json, tierflow.profile.machine as m; a = m.maxrss_bytes(); "
               "b = bytearray(100 * 2**20); b[::4096] = b'\\1' * len(b[::4096]); "
               "print(json.dumps({'base': a, 'peak': m.maxrss_bytes()}))")


def _peaks_beside_a_large_parent(start) -> dict:
    """What ``start(argv, env)`` (a child's JSON line) reads while this process holds 400
    MiB more than the child will."""
    ballast = bytearray(400 * 2**20)
    ballast[:: 4096] = b"\1" * len(ballast[:: 4096])  # touch every page
    out = start([sys.executable, "-c", _CHILD_PEAK], dict(os.environ, PYTHONPATH=SRC))
    del ballast
    return out


def test_child_peak_is_its_own_not_the_parents():
    """A child's ru_maxrss starts at its parent's peak when the parent execs it directly;
    run_json forks it through /bin/sh so that a big parent does not hide a small child."""
    out = _peaks_beside_a_large_parent(
        lambda argv, env: measure.run_json(argv, timeout=60, env=env))
    assert out["base"] < 300 * 2**20, out  # the parent holds > 400 MiB
    assert 90 * 2**20 < out["peak"] - out["base"] < 130 * 2**20, out


def test_a_child_started_directly_measures_its_own_peak():
    """maxrss_bytes reads the process's own high-water mark (VmHWM): a child a large parent
    starts directly (vfork, exec: ru_maxrss would begin at the parent's peak) measures a
    baseline and a peak of its own."""
    out = _peaks_beside_a_large_parent(lambda argv, env: json.loads(subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=60, check=True).stdout))
    assert out["base"] < 300 * 2**20, out  # the parent holds > 400 MiB
    assert 90 * 2**20 < out["peak"] - out["base"] < 130 * 2**20, out


def test_run_json_reports_crashes():
    with pytest.raises(measure.ChildError, match="boom"):
        measure.run_json([sys.executable, "-c", "raise SystemExit('boom')"], timeout=60)
    with pytest.raises(measure.ChildError, match="no JSON"):
        measure.run_json([sys.executable, "-c", "print('hello')"], timeout=60)


@pytest.mark.slow
def test_compare_quick_runs_end_to_end():
    proc = run_cli("compare", "--quick", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Plan (" in out and "plain PyTorch" in out and "tierflow" in out
    assert "losses differ by at most" in out
    # a budget is a promise: the smallest budget that works (and a new process's margin)
    # holds the steps' measured peak, malloc's caches and fit's own objects included
    share = re.search(r"\(([\d.]+)% of the ([\d.]+ MiB) budget\)", out)
    assert share and float(share.group(1)) <= 100.0, out


@pytest.mark.slow
def test_compare_infeasible_ram_is_one_line():
    """A --ram that cannot work is refused before plain PyTorch runs (which only the
    default budget needs beforehand)."""
    proc = run_cli("compare", "--quick", "--ram", "1KiB", timeout=240)
    assert_one_line_error(proc, "smallest")
    assert "measuring tierflow" in proc.stdout and "plain PyTorch" not in proc.stdout


def test_benchmark_report_renders(tmp_path):
    """benchmarks/remat.py's table and plot from synthetic records (no child processes)."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location(
        "remat", Path(__file__).resolve().parents[1] / "benchmarks" / "remat.py")
    remat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remat)
    g = remat.GIB
    peer = dict(kind="peer", status="ok", losses=[10.5, 10.4])
    runs = [dict(peer, config="plain", peak_above_baseline_bytes=8 * g, step_s_median=7.5, tok_s=546.0),
            dict(peer, config="hf-ckpt", peak_above_baseline_bytes=5 * g, step_s_median=7.8, tok_s=525.0),
            dict(kind="tierflow", config="tierflow-25%", fraction=0.25, budget_bytes=2 * g,
                 status="infeasible", smallest_bytes=3 * g, error="ram budget 2 GiB is below ..."),
            dict(kind="tierflow", config="tierflow-75%", fraction=0.75, budget_bytes=6 * g, status="ok",
                 losses=[10.5, 10.4], peak_above_baseline_bytes=int(6.1 * g), step_s_median=7.0,
                 tok_s=585.0, predicted_peak_bytes=6 * g, predicted_step_s=7.7)]
    result = {"date": "2026-01-01", "quick": False, "stem": "remat-2026-01-01",
              "workload": {"arch": "llama-134m", "seq": 1024, "batch": 4, "steps": 3},
              "workload_text": "W1", "runs": runs, "load_average": {"before": [1.0], "after": [1.5]},
              "machine": {"python": "3.11", "cpus": 2, "model_name": "CPU"}}
    text = remat.markdown(result)
    assert "| tierflow-25% | 2.00 | infeasible (smallest 3.00 GiB) |" in text
    assert "| tierflow-75% | 6.00 | 6.10 | yes (+1.7%, within 5%) | 7.00 | 585 | 0.93x |" in text
    assert "| 6.00 (75%) | 7.00 | hf-ckpt | 7.80 | yes |" in text
    remat.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
