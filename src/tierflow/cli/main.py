"""The ``tierflow`` command: one subcommand per module of this package, registered in the
order ``--help`` lists them, and the entry point that runs the one named.

Every user error (a bad flag, a bad size, a budget no plan fits) is printed as one line
``tierflow: error: ...`` on stderr with exit code 2, never as a traceback. Set
``TIERFLOW_TRACEBACK=1`` to see the traceback anyway.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from . import calibrate, compare, demo, generate, plan, plot, quantize, sweep, tokenize, train
from . import eval as evaluate
from .args import PROG, Parser, fail

COMMANDS = (demo, compare, tokenize, train, evaluate, generate, quantize, plot, plan, sweep,
            calibrate)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each sets ``func``, the function that runs it."""
    parser = Parser(prog=PROG, description="Train PyTorch models that do not fit in the memory "
                                           "you have.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _version() -> str:
    from .. import __version__
    return __version__


def _is_user_error(err: BaseException) -> bool:
    """A ValueError that tierflow raised: its class or the frame that raised it is tierflow's."""
    if not isinstance(err, ValueError):
        return False
    if type(err).__module__.split(".")[0] == "tierflow":
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = str(Path(__file__).resolve().parents[1])  # src/tierflow
    return tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(package)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierflow ARGV`` (default: ``sys.argv[1:]``); return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if not _is_user_error(err) or os.environ.get("TIERFLOW_TRACEBACK"):
            raise
        fail(str(err))


if __name__ == "__main__":
    sys.exit(main())
