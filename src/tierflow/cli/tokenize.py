"""``tierflow tokenize``: text files, directories, .jsonl files or the Python standard library
into train/eval token files and a tokenizer (the work is ``data/tokenize.py``'s)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import positive_int


def register(sub: Any) -> None:
    """Add ``tierflow tokenize`` to the subcommands ``sub``."""
    from ..data import DEFAULT_EVAL_FRACTION, DEFAULT_VOCAB_SIZE, STDLIB
    tok = sub.add_parser(
        "tokenize", help="turn text into train/eval token files and a tokenizer",
        description="Read text files, directories (recursive) and .jsonl files, train a "
                    "byte-level BPE tokenizer on them (or use --tokenizer), and write "
                    "DIR/train.bin, DIR/eval.bin, DIR/tokenizer.json and DIR/meta.json. "
                    f"INPUT '{STDLIB}' (or --stdlib) is the Python standard library's source.")
    tok.add_argument("inputs", nargs="*", metavar="INPUT",
                     help=f"text file, directory, .jsonl file, or '{STDLIB}'")
    tok.add_argument("--stdlib", action="store_true",
                     help="add the Python standard library's source to the inputs")
    tok.add_argument("--out", required=True, type=Path, metavar="DIR",
                     help="output directory (created if missing)")
    which = tok.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", type=Path, metavar="PATH",
                       help="a tokenizer.json or a Hugging Face model directory holding one")
    which.add_argument("--vocab-size", type=positive_int, metavar="N",
                       help=f"train a byte-level BPE of N ids (default {DEFAULT_VOCAB_SIZE})")
    tok.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, metavar="F",
                     help="fraction of the documents held out in eval.bin "
                          f"(default {DEFAULT_EVAL_FRACTION}; at least one document)")
    tok.add_argument("--text-field", default="text", metavar="NAME",
                     help="the field holding the text in .jsonl files (default 'text')")
    tok.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Tokenize the INPUTs (and the stdlib with --stdlib); print the one-line summary."""
    from ..data import STDLIB
    from ..data.tokenize import tokenize
    inputs = [*args.inputs, *([STDLIB] if args.stdlib else [])]
    result = tokenize(inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      eval_fraction=args.eval_fraction, text_field=args.text_field)
    print(result.summary(), flush=True)
    return 0
