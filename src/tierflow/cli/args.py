"""What the commands share: the parser whose errors are one line, the exit that prints one,
and the argparse types of their flags (whole numbers, bounded numbers, sizes).

A memory size means the same in every command: a byte string (``24GiB``, ``500MB``, ``512B``)
or a bare number of GiB (``--ram 64``), as RAM and GPU memory are quoted; ``tierflow plan
--ram 64`` has always read it so. A bare number of 2**20 or more is refused: read as GiB it is
more memory than a machine has, so it is a count of bytes written without its unit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from ..core.errors import TierflowError
from ..core.units import parse_bytes, size_with_unit

PROG = "tierflow"

# --enforce and --unenforced-ok, as train and generate both take them (checked by
# ``enforce.check_flags``, entered by ``enforce.hold``)
ENFORCE_HELP = ("the kernel holds the run to --ram: once its plan is made, before the work "
                "starts (train: the first step; generate: the first weight read), it moves "
                "itself into a memory cgroup (v2's memory.max, else v1's "
                "memory.limit_in_bytes; page cache counted, no swap) of --ram above its "
                "post-import RSS; where none can be made, it says why and stops (exit code 2)")
UNENFORCED_OK_HELP = ("with --enforce: where no memory cgroup can be made, say why and run on "
                      "without one")


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        fail(f"{message} (see '{self.prog} --help')")


def fail(message: str) -> NoReturn:
    """Print ``tierflow: error: MESSAGE`` as one line on stderr and exit with code 2."""
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def memory_size(text: str, flag: str) -> str:
    """``text`` as the library reads a size (``units.size_with_unit``: a bare number is GiB);
    a TierflowError naming ``flag``, the value and the fix when it is none."""
    try:
        return size_with_unit(text, flag)
    except ValueError as e:
        raise TierflowError(str(e)) from None


def memory_bytes(text: str, flag: str) -> int:
    """The bytes of the memory size ``text`` (``memory_size``)."""
    return parse_bytes(memory_size(text, flag), what=flag)


def size_text(text: str) -> str:
    """An argparse type: a memory size (``memory_size``), as the text the library parses."""
    try:
        return memory_size(text, "size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def size(text: str) -> int:
    """An argparse type: a memory size (``memory_size``) in bytes."""
    return parse_bytes(size_text(text))


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def bounded_number(kind: type, what: str, minimum: float, *,
                   above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` number >= ``minimum`` (> with ``above``), finite."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            name = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if value != value or value in (float("inf"), float("-inf")) or value < minimum or (
                above and value == minimum):
            raise argparse.ArgumentTypeError(
                f"{text} must be {'above' if above else 'at least'} {minimum} ({what})")
        return value
    return parse


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``: the checkpoint that generate and quantize read."""
    parser.add_argument("--model", required=True, type=Path, metavar="DIR",
                        help="checkpoint directory with config.json and model.safetensors, or "
                             "a tierflow train --out directory (its latest step_N)")


def add_enforce_arguments(parser: argparse.ArgumentParser) -> None:
    """``--enforce`` and ``--unenforced-ok`` (None unless given, as train's flags are)."""
    parser.add_argument("--enforce", action="store_true", default=None, help=ENFORCE_HELP)
    parser.add_argument("--unenforced-ok", dest="unenforced_ok", action="store_true",
                        default=None, help=UNENFORCED_OK_HELP)
