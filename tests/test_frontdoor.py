"""The front door cannot rot: every CLI option has help and every exported name a docstring,
the docs build strictly with no broken internal link, the README's results table is the
rendered one, its Python example trains and saves, its journeys run on a tiny model, and
`tierflow plan`'s refusal names changes that fit. (The quickstart's `./run demo --quick` is
tests/test_demo.py's.)"""
import argparse
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_support import assert_error_line, run_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import references  # noqa: E402  (docs/hooks/references.py: the reference generators)


def test_every_cli_option_has_help():
    missing = []
    for name, parser in references.subcommands(references._parser()).items():
        for action in references.options(parser):
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"tierflow {name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help: {missing}"
    assert "tierflow train" in references.cli_markdown()


def test_every_exported_name_and_its_public_methods_have_docstrings():
    import tierflow
    missing = []
    for name, path in references.api_names():
        obj = getattr(tierflow, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(path)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (callable(member) or isinstance(
                        member, (property, classmethod, staticmethod))):
                    continue
                doc = member.__doc__ if not isinstance(member, (staticmethod, classmethod)) \
                    else member.__func__.__doc__
                if not (doc or "").strip() and not _inherits_doc(obj, attr):
                    missing.append(f"{path}.{attr}")
    assert not missing, f"public API without a docstring: {missing}"


def _inherits_doc(cls, attr):
    """An override of a documented method (e.g. nn.Module.forward) keeps the base's doc."""
    return any(attr in vars(base) and (getattr(base, attr).__doc__ or "").strip()
               for base in cls.__mro__[1:])


def test_results_table_is_rendered_from_committed_json():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_results.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "<!-- results:start -->\n| workload |" in README.read_text()


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 16_000, f"README is {len(text.encode())} bytes"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", re.sub(r"```.*?```", "", text, flags=re.S)), \
        "a commit hash in the README's prose"
    assert not re.search(r"\bissue[- ]?\d+", text, re.I) and "../shared" not in text
    assert "./run demo" in text and "./run test" in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which is missing"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_docs_build_strictly_with_no_broken_internal_link(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                           str(site)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = []
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#:?]+)(?:#[^"]*)?"', page.read_text()):
            if href.startswith(("//", "mailto")):
                continue
            target = (site / href.lstrip("/") if href.startswith("/") else
                      page.parent / href).resolve()
            if not (target.exists() or (target / "index.html").exists()):
                broken.append(f"{page.relative_to(site)} -> {href}")
    assert not broken, f"broken internal links: {broken[:10]}"
    cli = (site / "cli" / "index.html").read_text()
    assert "--train-only" in cli and "tierflow plan" in cli
    assert "smallest" in (site / "api" / "index.html").read_text()


def _block(text: str, heading: str, lang: str) -> list[str]:
    """The ``lang`` code blocks of the section under ``heading``."""
    section = text.split(heading, 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_readme_api_example_shows_the_loss_falling_and_saves_the_model(tmp_path):
    (code,) = _block(README.read_text(), "## Python API", "python")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, proc.stdout
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    assert sum(p.numel() for p in saved.parameters()) > 0


def _commands(blocks: list[str]) -> list[list[str]]:
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line.split(" #")[0]) for line in lines
            if line.strip().startswith("tierflow ")]


def _tiny(argv: list[str], env: dict, corpus: Path, disk: Path, seq_len: str = "32",
          instruct: Path | None = None) -> list[str]:
    """A journey's command on the tiny model: same flags, tiny values (``seq_len`` for the
    trainer's and the tokenizer's sequences, ``instruct``: the tiny model directory with a
    chat template that stands for MODEL_DIR)."""
    command, out, i = argv[1], [argv[1]], 2
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and arg.startswith("--") and \
            not argv[i + 1].startswith("--") else None
        if value is None:
            out.append(str(corpus) if arg == "my_docs/" else arg)
            i += 1
            continue
        planning = command in ("plan", "sweep")
        if value == "MODEL_DIR":
            value = str(instruct)
        elif arg == "--model":
            value = ("llama-20m" if planning else
                     env["model"] if not value.startswith("runs/") else
                     re.sub(r"step_\d+", "step_2", value))
        elif arg == "--seq-len":
            value = "256" if planning else seq_len
        elif planning and arg in ("--gpu", "--ram"):
            value = ",".join(value.split(",")[:2])  # a sweep's lists: their first two
        elif arg == "--steps":
            value = "2"
        elif arg == "--batch-size":
            value = "2"
        elif arg == "--vocab-size":
            value = "300"
        elif arg == "--disk":
            value = str(disk)
        elif arg == "--train-only":  # the tiny model and llama-20m have layers 0 and 1 (0-3)
            value = re.sub(r"layers\.(\d\[\d+\]|\d+)", "layers.1", value)
        elif arg == "--prompt":
            value = "def"
        out += [arg, value]
        i += 2
    if command == "train":
        out += ["--eval-every", "0", "--dtype", "fp32"]
        out += [] if "--steps" in out else ["--steps", "2"]
        out += [] if "--seq-len" in out else ["--seq-len", "32", "--batch-size", "2"]
        if "--gpu" in out and not torch.cuda.is_available():
            out.append("--simulate-gpu")
    if command == "generate":
        out += ["--max-new-tokens", "4"]
    return out


def test_readme_journeys_run_on_a_tiny_model(tmp_path, train_env, monkeypatch, capsys):
    commands = _commands(_block(README.read_text(), "## Three journeys", "bash"))
    assert [c[1] for c in commands] == ["tokenize", "train", "generate", "plan", "train",
                                        "plan", "train"]
    corpus = tmp_path / "my_docs"
    corpus.mkdir()
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "heapq.py"):
        (corpus / f"{name}.txt").write_text((Path(os.__file__).parent / name).read_text())
    disk = tmp_path / "disk"
    disk.mkdir()
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        tiny = _tiny(argv, train_env, corpus, disk)
        code, out, err = run_main(*tiny, capsys=capsys)
        assert code in (0, None), f"tierflow {' '.join(tiny)}: {err[-2000:]}"
    assert (tmp_path / "runs" / "tuned" / "step_2").is_dir()


GUIDES = ("guide/larger-than-ram.md", "guide/fine-tune.md", "guide/one-gpu.md",
          "finetuning.md")  # in this order: a later guide trains on an earlier one's run


def test_the_guides_commands_run_on_a_tiny_model(tmp_path, train_env, monkeypatch, capsys):
    """Every ``tierflow`` command of the guides, in order, on the tiny model (the torchrun
    line of the multi-worker guide is the README's, which tests/test_torchrun_flags.py runs
    under torchrun)."""
    from sft_support import chat_model_dir, chats, pairs, write_jsonl, write_parquet

    corpus = tmp_path / "my_docs"
    corpus.mkdir()
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "heapq.py"):
        (corpus / f"{name}.txt").write_text((Path(os.__file__).parent / name).read_text())
    write_jsonl(tmp_path / "notes.jsonl", [{"text": (Path(os.__file__).parent / "glob.py")
                                            .read_text()}])
    write_jsonl(tmp_path / "chats.jsonl", chats())
    write_parquet(tmp_path / "pairs.parquet", pairs())
    instruct = chat_model_dir(tmp_path / "instruct")
    disk = tmp_path / "disk"
    disk.mkdir()
    monkeypatch.chdir(tmp_path)
    ran = []
    for guide in GUIDES:
        blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / guide).read_text(), re.S)
        for argv in _commands(blocks):
            # whole chats in a row: the fine-tune's commands and those reading its data
            seq_len = "256" if "MODEL_DIR" in argv or any("sft" in a for a in argv) else "32"
            tiny = _tiny(argv, train_env, corpus, disk, seq_len, instruct)
            code, out, err = run_main(*tiny, capsys=capsys)
            assert code in (0, None), f"{guide}: tierflow {' '.join(tiny)}: {err[-2000:]}"
            ran.append(f"{guide}: {argv[1]}")
    assert len(ran) >= 14, ran
    assert (tmp_path / "runs" / "lora" / "step_2" / "merged").is_dir()


def test_plan_refusal_names_the_changes_that_fit(capsys):
    code, _, err = run_main("plan", "--model", "llama-20m", "--hardware", "rtx4090", "--gpu",
                            "0.3", "--ram", "0.05", "--seq-len", "512", capsys=capsys)
    assert code == 2
    assert_error_line(err, ["nothing fits", "these fit:"])
    fits = dict(re.findall(r"(--[^;(]+?) \(PREDICTED ([\d,]+) tok/s\)", err))
    assert "--master none --optim-dtype bf16" in fits and "--disk DIR" in fits, err
    assert all(int(v.replace(",", "")) > 0 for v in fits.values())
