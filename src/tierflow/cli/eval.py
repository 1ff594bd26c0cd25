"""``tierflow eval``: the loss and perplexity of a model directory or checkpoint on held-out
token files, computed as ``tierflow train``'s evaluations compute it (``train/evaluate.py``):
the step planned under the budgets given, the loss normalised over the tokens it counts (a
loss mask's targets, packed documents attending within themselves). Bad input is refused
before torch is imported."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.errors import TierflowError
from .args import bounded_number, memory_size

DEFAULT_SEQ_LEN = 256  # tierflow train's
DEFAULT_BATCH_SIZE = 4


def register(sub: Any) -> None:
    """Add ``tierflow eval`` to the subcommands ``sub``."""
    ev = sub.add_parser(
        "eval", help="loss and perplexity of a model on held-out token files",
        description="Compute the mean loss (and perplexity) of a model directory or a "
                    "tierflow train checkpoint on token files written by 'tierflow tokenize', "
                    "as tierflow train evaluates: plain text in consecutive windows of "
                    "--seq-len, fine-tuning records packed whole into rows that attend within "
                    "their documents, only their loss mask's targets counted; the loss is "
                    "normalised over the tokens counted. Under --ram (--gpu, --disk) the "
                    "model runs through the plan tierflow train would make for it. One line "
                    "per file (--json: one JSON object per file).")
    ev.add_argument("files", nargs="+", metavar="FILE",
                    help="a token file (.bin), or a directory written by 'tierflow tokenize' "
                         "for its eval.bin")
    ev.add_argument("--model", required=True, metavar="DIR",
                    help="model directory with config.json and model.safetensors (e.g. an "
                         "OUT/step_N of tierflow train, or OUT/step_N/merged of a --lora "
                         "--merge run), or a tierflow train --out directory (its latest "
                         "step_N)")
    ev.add_argument("--seq-len", type=bounded_number(int, "tokens per row", 1),
                    default=DEFAULT_SEQ_LEN, metavar="N",
                    help=f"tokens per row, as tierflow train's --seq-len (default "
                         f"{DEFAULT_SEQ_LEN}); a packed row holds whole documents")
    ev.add_argument("--batch-size", type=bounded_number(int, "rows per batch", 1),
                    default=DEFAULT_BATCH_SIZE, metavar="N",
                    help=f"rows per batch (default {DEFAULT_BATCH_SIZE})")
    ev.add_argument("--max-batches", type=bounded_number(int, "batches", 1), default=None,
                    metavar="N", help="evaluate the first N batches of each file only "
                                      "(default: the whole file)")
    ev.add_argument("--ram", default=None, metavar="SIZE",
                    help="RAM budget, e.g. 2GiB (a bare number is GiB): the model runs "
                         "through tierflow train's plan under it")
    ev.add_argument("--gpu", default=None, metavar="SIZE",
                    help="GPU budget, e.g. 8GiB: evaluate on the CUDA GPU, host RAM (--ram) "
                         "below it")
    ev.add_argument("--disk", default=None, metavar="DIR",
                    help="an existing directory for the disk tier: the weights that do not "
                         "fit the budgets stream from a scratch directory there")
    ev.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="matmuls in bf16 autocast or fp32 (auto: bf16 where the CPU has "
                         "native bf16), as tierflow train's --dtype")
    ev.add_argument("--allow-other-tokenizer", action="store_true",
                    help="evaluate token files tokenized with another tokenizer than the "
                         "model directory's (refused by default: the ids would mean other "
                         "tokens)")
    ev.add_argument("--json", action="store_true",
                    help="print one JSON object per file (file, loss, ppl, tokens, rows, "
                         "batches, batch_size, seq_len, packed, ms) instead of the line")
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check everything before torch is imported, then evaluate each file and print it."""
    from ..data.packing import check_fits
    from ..generate.options import checkpoint_directory
    from ..train.data_dir import open_token_file
    from ..train.options import TrainOptions
    from ..train.tokenizer_match import check_tokenizer

    model = checkpoint_directory(args.model)
    values = dict(model=str(model), data=str(args.files[0]), seq_len=args.seq_len,
                  batch_size=args.batch_size, dtype=args.dtype, disk=args.disk,
                  gpu=memory_size(args.gpu, "--gpu") if args.gpu is not None else None,
                  ram=memory_size(args.ram, "--ram") if args.ram is not None else None,
                  allow_other_tokenizer=args.allow_other_tokenizer)
    opts = TrainOptions(**values, given=frozenset(values)).check_flags()
    datas = [open_token_file(f) for f in args.files]
    masked = [d.eval.path for d in datas if d.eval.mask is not None]
    if masked and len(masked) < len(datas):
        plain = next(d.eval.path for d in datas if d.eval.mask is None)
        raise TierflowError(f"{masked[0]} holds fine-tuning records (a loss mask) and {plain} "
                            "plain text: the step is planned for one kind of batch; fix: "
                            "evaluate them in two calls")
    for data in datas:
        check_tokenizer(opts.model, data, opts.allow_other_tokenizer)
        if data.eval.mask is not None:
            check_fits(data.eval, opts.seq_len)
    if opts.disk:
        from ..core.paths import require_disk_directory
        require_disk_directory(opts.disk)
    from ..train.evaluate import evaluate_files
    for result in evaluate_files(opts, datas, max_batches=args.max_batches):
        print(json.dumps(result.record()) if args.json else result.line(), flush=True)
    return 0

