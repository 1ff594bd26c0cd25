"""A memory size means the same in every command: a bare number is GiB (``tierflow plan --ram
64`` as ``tierflow train --ram 64``), a byte string is what it says, and a bare number too large
to be GiB (bytes written without their unit) is refused in one line naming the value and the
fix, before any slow work."""
from __future__ import annotations

from importlib import import_module

import pytest
from cli_support import assert_error_line, run_main

from tierflow.cli.main import build_parser, main
from tierflow.cli.train import from_args
from tierflow.core.errors import TierflowError
from tierflow.core.units import parse_bytes

GIB = 2**30
COMMANDS = ["train", "generate", "compare", "demo", "plan", "sweep"]


class Stop(Exception):
    """Raised by a stand-in for the work a command would do once its flags are read."""


def budget(command: str, flag: str, value: str, monkeypatch, tmp_path) -> int:
    """The bytes that ``tierflow COMMAND FLAG VALUE`` hands to the work it runs."""
    seen = {}

    def stop(key, get):
        def stand_in(*args, **kwargs):
            seen[key] = get(*args, **kwargs)
            raise Stop
        return stand_in

    if command == "train":
        args = build_parser().parse_args(["train", "--model", "llama-20m", "--data", "d",
                                          flag, value])
        return parse_bytes(getattr(from_args(args), flag[2:]))
    if command in ("compare", "demo"):
        return parse_bytes(getattr(build_parser().parse_args([command, flag, value]), flag[2:]))
    if command == "generate":
        monkeypatch.setattr("tierflow.generate.options.check_request",
                            stop("ram", lambda request: request.ram))
        argv = ["generate", "--model", str(tmp_path), "--prompt", "x", flag, value]
    elif command == "plan":
        monkeypatch.setattr(import_module("tierflow.sim.predict"), "predict",  # the module
                            stop("ram", lambda setup: getattr(setup, flag[2:])))
        argv = ["plan", "--model", "llama-20m", "--hardware", "h100-sxm", "--seq-len", "1024",
                flag, value]
    else:
        monkeypatch.setattr(import_module("tierflow.sim.sweep"), "sweep",
                            stop("ram", lambda base, models, seqs, gpus, rams:
                                 (gpus if flag == "--gpu" else rams)[0]))
        argv = ["sweep", "--model", "llama-20m", "--hardware", "h100-sxm", "--seq-len", "1024",
                "-o", str(tmp_path / "sweep"), flag, value]
    with pytest.raises(Stop):
        main(argv)
    return parse_bytes(seen["ram"])


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bare_number_is_gib_in_every_command(command, monkeypatch, tmp_path):
    for value, expected in (("2", 2 * GIB), ("1.5", GIB * 3 // 2), ("512MiB", 512 << 20),
                            ("512B", 512)):
        assert budget(command, "--ram", value, monkeypatch, tmp_path) == expected, value


@pytest.mark.parametrize("command", ["train", "plan", "sweep"])
def test_a_bare_gpu_size_is_gib_too(command, monkeypatch, tmp_path):
    assert budget(command, "--gpu", "24", monkeypatch, tmp_path) == 24 * GIB


@pytest.mark.parametrize("command", COMMANDS)
def test_bytes_without_their_unit_are_refused_in_one_line(command, capsys, tmp_path):
    argv = {"train": ["train", "--model", "llama-20m", "--data", str(tmp_path)],
            "generate": ["generate", "--model", str(tmp_path), "--prompt", "x"],
            "compare": ["compare"], "demo": ["demo", "--out", str(tmp_path)],
            "plan": ["plan", "--model", "llama-20m", "--hardware", "h100-sxm", "--seq-len", "8"],
            "sweep": ["sweep", "--model", "llama-20m", "--hardware", "h100-sxm", "--seq-len",
                      "8", "-o", str(tmp_path / "sweep")]}[command]
    code, out, err = run_main(*argv, "--ram", "4294967296", capsys=capsys)
    assert code == 2 and out == "", err
    assert_error_line(err, ["4294967296", "a bare number is GiB", "below 1048576",
                            "4.00 GiB", "4294967296B"])


def test_the_config_file_reads_sizes_as_the_flags_do(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "llama-20m"\ndata = "d"\nram = 16\ngpu = "8"\n')
    args = build_parser().parse_args(["train", "--config", str(config)])
    assert (from_args(args).ram, from_args(args).gpu) == ("16GiB", "8GiB")
    config.write_text('model = "llama-20m"\ndata = "d"\nram = 17179869184\n')
    with pytest.raises(TierflowError, match="--ram 17179869184: a bare number is GiB"):
        from_args(build_parser().parse_args(["train", "--config", str(config)]))
