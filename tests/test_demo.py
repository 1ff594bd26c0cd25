"""`tierflow demo --quick`: the LLM workflow end to end on a subset of the stdlib, offline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierflow.cli.demo import PROMPT

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_demo(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TIERFLOW_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "tierflow", "demo", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.exclusive  # timed
def test_demo_quick_end_to_end_then_reuses_its_token_files(tmp_path):
    out = tmp_path / "demo"
    start = time.perf_counter()
    proc = run_demo("--quick", "--out", str(out))
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 90, f"the quick demo took {elapsed:.0f} s"
    text = proc.stdout
    for number in range(1, 6):
        assert f"=== [{number}/5]" in text, text
    assert "[Plan]" in text and "[T] step 1 " in text and "[V] step" in text

    # token files, a checkpoint that transformers can load, the plot, the sample
    assert (out / "data" / "meta.json").is_file() and (out / "data" / "train.bin").is_file()
    steps = [p for p in out.glob("step_*") if p.is_dir()]
    assert len(steps) == 1, steps
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.json"):
        assert (steps[0] / name).is_file(), name
    png = out / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    sample = (out / "sample.txt").read_text(encoding="utf-8")
    assert sample.startswith(PROMPT) and len(sample.split("[generate]")[0]) > len(PROMPT) + 5
    assert "[generate]" in text and str(png) in text

    # eval loss falls
    evals = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert len(evals) >= 2, evals
    assert evals[-1] < evals[0], evals

    # a second run finds the first one's token files (meta.json with the same inputs and
    # vocab) and does not tokenize again
    assert "tierflow tokenize:" in text
    again = run_demo("--quick", "--out", str(out), "--steps", "2")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"reusing {out / 'data'}" in again.stdout
    assert "tierflow tokenize:" not in again.stdout


def test_demo_bad_flags_are_one_line(tmp_path):
    proc = run_demo("--ram", "lots", timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("tierflow: error: ")
    assert len(proc.stderr.strip().splitlines()) == 1 and "--ram" in proc.stderr


def test_demo_sft_quick_tunes_on_docstring_answers_then_evals_and_chats(tmp_path, capsys):
    """``demo --sft``: docstring Q&A as chat records, a model directory whose tokenizer has a
    chat template, the answers alone as targets, the held-out answers' loss before and after
    (tierflow eval's function), and greedy ``--chat`` replies (a few steps: the flow, not the
    quality)."""
    from cli_support import run_main
    from tierflow.data.stdlib_qa import first_sentence
    from tierflow.data.tokenfile import TokenFile

    out = tmp_path / "sft"
    code, text, err = run_main("demo", "--sft", "--quick", "--steps", "6", "--out", str(out),
                               capsys=capsys)
    assert code == 0, text[-3000:] + err[-3000:]
    for number in range(1, 6):
        assert f"=== [{number}/5]" in text, text
    records = [json.loads(line) for line in (out / "qa.jsonl").read_text().splitlines()]
    assert len(records) > 300
    assert {"role": "user", "content": "What does json.dumps do?"} in records[1]["messages"]
    config = json.loads((out / "step_6" / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["eos_token"] == "<|im_end|>"
    tokens = TokenFile.open(out / "data" / "train.bin")
    assert tokens.mask is not None and 0 < tokens.mask.sum() < 0.8 * len(tokens)  # answers
    before, after = (float(line.split("loss ")[1].split()[0]) for line in text.splitlines()
                     if line.startswith(("before: ", "after:  ")))
    assert after < before
    sample = (out / "sample.txt").read_text()
    assert sample.count("> What does ") == sample.count("[generate] ") >= 2
    assert "<|im" not in sample and "(held out)" in sample
    assert first_sentence("f(x) -> y\n\nReturns y.") is None
    assert first_sentence("Return the sum of\n  the values.  More text.") == \
        "Return the sum of the values."
