"""Every flag of ``tierflow train`` passes through torchrun.

torchrun parses its whole command line, the training script's arguments included, with
argparse's prefix matching: a script flag that is a prefix of several of torchrun's own
options (``--log``: ``--log-dir``, ``--logs-specs``) stops torchrun before tierflow starts. The
README's torchrun command, with each train flag added, is parsed by torchrun's own parser and
what it hands on by tierflow's; a flag torchrun takes must have a second name it leaves alone,
named in the flag's help.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import STDLIB_FILES, make_train_env, records
from torch.distributed.run import get_args_parser

from tierflow.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


def readme_torchrun_command() -> list[str]:
    """The README's torchrun command line (its continuation lines joined), as argv."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^torchrun (?:.*\\\n)*.*$", text, re.M)
    assert match, "the README shows no torchrun command"
    return shlex.split(match.group(0).replace("\\\n", " "))


def train_flags() -> list[argparse.Action]:
    """The options of ``tierflow train`` (``--help`` aside)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["train"]._actions if a.option_strings and a.dest != "help"]


def through_torchrun(argv: list[str]) -> list[str] | None:
    """The arguments torchrun hands to ``-m tierflow`` for ``torchrun ARGV``; None when
    torchrun refuses the line itself."""
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return None
    assert args.module and args.training_script == "tierflow", args
    return args.training_script_args


def test_the_readme_command_reaches_tierflow():
    command = readme_torchrun_command()
    assert command[0] == "torchrun" and command[command.index("-m") + 1] == "tierflow"
    tail = command[command.index("tierflow") + 1:]
    assert through_torchrun(command[1:]) == tail
    assert build_parser().parse_args(tail).command == "train"


@pytest.mark.parametrize("flag", train_flags(), ids=lambda a: a.option_strings[0])
def test_every_train_flag_has_a_name_torchrun_hands_on(flag, capsys):
    command = readme_torchrun_command()
    tail = command[command.index("tierflow") + 1:]
    value = [] if flag.nargs == 0 else [str(flag.choices[-1]) if flag.choices else "7"]
    handed_on = []
    for name in flag.option_strings:
        forms = [[name, *value]] + ([[f"{name}={value[0]}"]] if value else [])
        if all(through_torchrun([*command[1:], *form]) == [*tail, *form] for form in forms):
            handed_on.append(name)
    capsys.readouterr()  # torchrun's usage, printed when it refused a name
    assert handed_on, f"torchrun takes every name of {flag.dest}: {flag.option_strings}"
    for name in handed_on:
        parsed = build_parser().parse_args([*tail, name, *value])
        assert getattr(parsed, flag.dest) is not None, (name, parsed)
    if len(handed_on) < len(flag.option_strings):  # the help says which name to write
        assert any(name in flag.help for name in handed_on), flag.help


@pytest.mark.slow
def test_log_file_and_master_copy_under_torchrun(tmp_path):
    """One rank launched by torchrun itself: the flags that torchrun would take by their
    first names reach tierflow by their second ones."""
    env = make_train_env(tmp_path, STDLIB_FILES[:2])
    log = tmp_path / "elsewhere.jsonl"
    child = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for key in ("TIERFLOW_TRACEBACK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        child.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "tierflow", "train", "--model", env["model"], "--data", env["data"],
         "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--eval-every", "0",
         "--master-copy", "fp32", "--out", str(tmp_path / "run"), "--log-file", str(log)],
        env=child, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in records(log, "train")] == [1, 2]
