"""``tierflow quantize``: an int8 copy of a checkpoint for ``tierflow generate`` (the work is
``generate/quantize.py``'s)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import add_checkpoint_argument


def register(sub: Any) -> None:
    """Add ``tierflow quantize`` to the subcommands ``sub``."""
    q = sub.add_parser(
        "quantize", help="copy a checkpoint with int8 linear weights, for generate",
        description="Write a copy of a checkpoint whose linear layers hold int8 weights with "
                    "one scale per output channel (half of bf16's bytes), read one tensor at a "
                    "time. tierflow generate reads it (faster, and fewer bytes per token when "
                    "it streams under --ram); the text differs slightly from the original's. "
                    "Training refuses it.")
    add_checkpoint_argument(q)
    q.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="the new directory to write (never overwritten)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the int8 copy; bad input fails before torch loads."""
    from ..generate.options import check_new_directory, checkpoint_directory
    directory = checkpoint_directory(args.model)
    check_new_directory(args.out)
    from ..generate.quantize import quantize_checkpoint
    quantize_checkpoint(directory, args.out)
    return 0
