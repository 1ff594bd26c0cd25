"""``tierflow tokenize``: text files, directories, record files (.jsonl, .json, .parquet,
.csv: chat, prompt/completion or text records) or the Python standard library into train/eval
token files and a tokenizer (the work is ``data/tokenize.py``'s)."""
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
        description="Read text files, directories (recursive) and record files (.jsonl, "
                    ".json arrays, .parquet, .csv), train a byte-level BPE tokenizer on them "
                    "(or use --tokenizer), and write DIR/train.bin, DIR/eval.bin, the tokenizer "
                    "files and DIR/meta.json. A record is a chat ('messages' with roles, "
                    "rendered by the --tokenizer model directory's chat template), a 'prompt' "
                    "+ 'completion' pair, or text (--text-field); only the assistant turns "
                    "and completions count in the loss. To fine-tune a model, pass its "
                    "directory as --tokenizer. "
                    f"INPUT '{STDLIB}' (or --stdlib) is the Python standard library's source.")
    tok.add_argument("inputs", nargs="*", metavar="INPUT",
                     help=f"text file, directory, record file, or '{STDLIB}'")
    tok.add_argument("--stdlib", action="store_true",
                     help="add the Python standard library's source to the inputs")
    tok.add_argument("--out", required=True, type=Path, metavar="DIR",
                     help="output directory (created if missing)")
    which = tok.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", type=Path, metavar="PATH",
                       help="a Hugging Face model directory (the model to fine-tune: its "
                            "tokenizer and chat template) or a tokenizer.json")
    which.add_argument("--vocab-size", type=positive_int, metavar="N",
                       help=f"train a byte-level BPE of N ids (default {DEFAULT_VOCAB_SIZE})")
    tok.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, metavar="F",
                     help="fraction of the documents held out in eval.bin "
                          f"(default {DEFAULT_EVAL_FRACTION}; at least one document)")
    tok.add_argument("--text-field", default="text", metavar="NAME",
                     help="the field or column holding the text of text records "
                          "(default 'text')")
    tok.add_argument("--seq-len", type=positive_int, metavar="N",
                     help="refuse a document longer than N tokens (the --seq-len you will "
                          "train with: a packed row holds whole documents)")
    tok.add_argument("--truncate", action="store_true",
                     help="with --seq-len: cut longer documents to N tokens instead")
    tok.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Tokenize the INPUTs (and the stdlib with --stdlib); print the one-line summary."""
    from ..data import STDLIB
    from ..data.tokenize import tokenize
    inputs = [*args.inputs, *([STDLIB] if args.stdlib else [])]
    result = tokenize(inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      eval_fraction=args.eval_fraction, text_field=args.text_field,
                      seq_len=args.seq_len, truncate=args.truncate)
    print(result.summary(), flush=True)
    return 0
