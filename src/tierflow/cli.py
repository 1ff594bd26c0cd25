"""The ``tierflow`` command line: demo, compare, tokenize, train, generate, quantize, plot, and
the simulator's plan, sweep and calibrate (registered from ``cli_sim.py``).

Every user error (a bad flag, a bad size, a budget no plan fits) is printed as one line
``tierflow: error: ...`` on stderr with exit code 2, never as a traceback. Set
``TIERFLOW_TRACEBACK=1`` to see the traceback anyway.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from . import measure
from .cli_sim import add_calibrate, add_plan, add_sweep
from .config import PLANNERS
from .units import parse_bytes

PROG = "tierflow"


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = f" (see '{self.prog} --help')"
        _fail(f"{message}{hint}")


def _fail(message: str) -> None:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, what="size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Train PyTorch models that do not fit in the memory "
                                            "you have.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    _add_demo(sub)
    _add_compare(sub)
    _add_tokenize(sub)
    _add_train(sub)
    _add_generate(sub)
    _add_quantize(sub)
    _add_plot(sub)
    add_plan(sub)
    add_sweep(sub)
    add_calibrate(sub)
    return parser


def _version() -> str:
    from . import __version__
    return __version__


# ---------------------------------------------------------------- demo and compare

def _size_text(text: str) -> str:
    """An argparse type: a size such as 2GiB, checked, kept as written."""
    _size(text)
    return text


def _add_demo(sub: Any) -> None:
    """Register ``tierflow demo`` (the work is in tierflow.demo)."""
    demo = sub.add_parser(
        "demo", help="the LLM workflow on the Python standard library, offline, in minutes",
        description="Tokenize the Python standard library's source (a byte-level BPE trained on "
                    "it), train a small Llama on it under a RAM budget with evaluation, save the "
                    "checkpoint, sample from it after a prompt ending in 'def ' and plot the run. "
                    "Everything goes to --out; token files already there are reused.")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), metavar="DIR",
                      help="where the token files, checkpoint, log, plot and sample go "
                           "(default runs/demo)")
    demo.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                      help="training steps (default 400; 60 with --quick)")
    demo.add_argument("--ram", type=_size_text, default=None, metavar="SIZE",
                      help="RAM budget of the training step (default 1GiB; 512MiB with --quick)")
    demo.add_argument("--quick", action="store_true",
                      help="a tiny Llama on 60 stdlib files with a 512-id vocab: under a minute")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args)


def _add_compare(sub: Any) -> None:
    """Register ``tierflow compare`` (the work is in tierflow.demo)."""
    compare = sub.add_parser(
        "compare", help="fit a small Llama under a RAM budget; compare with plain PyTorch",
        description="Fit a small Llama-style model (random weights, random tokens) under a RAM "
                    "budget, print the plan, then measure plain PyTorch and tierflow, each in a "
                    "fresh process: peak RSS above the post-import baseline, median step time, "
                    "tokens/s and the loss of every step.")
    compare.add_argument("--ram", type=_size, default=None, metavar="SIZE",
                         help="tierflow's RAM budget, e.g. 600MiB (default: half of plain "
                              "PyTorch's measured peak)")
    compare.add_argument("--arch", choices=sorted(measure.ARCHS), default=None,
                         help="model size (default llama-20m; llama-tiny with --quick)")
    compare.add_argument("--seq", type=_positive_int, default=None,
                         help="sequence length (default 512)")
    compare.add_argument("--batch", type=_positive_int, default=None,
                         help="batch size (default 4)")
    compare.add_argument("--steps", type=_positive_int, default=None,
                         help="timed steps after one warm-up step (default 3)")
    compare.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                         help="bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16)")
    compare.add_argument("--planner", choices=PLANNERS, default="auto",
                         help="tierflow's planner (default auto: keep-all when it fits, else rotor)")
    compare.add_argument("--quick", action="store_true",
                         help="a tiny model and short sequences: a smoke test in seconds")
    compare.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from .demo import run_compare
    return run_compare(args)


# ---------------------------------------------------------------- tokenize

def _add_tokenize(sub: Any) -> None:
    """Register ``tierflow tokenize`` (the work is in tierflow.data.tokenize)."""
    from .data import DEFAULT_EVAL_FRACTION, DEFAULT_VOCAB_SIZE, STDLIB
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
    which.add_argument("--vocab-size", type=_positive_int, metavar="N",
                       help=f"train a byte-level BPE of N ids (default {DEFAULT_VOCAB_SIZE})")
    tok.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, metavar="F",
                     help="fraction of the documents held out in eval.bin "
                          f"(default {DEFAULT_EVAL_FRACTION}; at least one document)")
    tok.add_argument("--text-field", default="text", metavar="NAME",
                     help="the field holding the text in .jsonl files (default 'text')")
    tok.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Tokenize the INPUTs (and the stdlib with --stdlib); print the one-line summary."""
    from .data import STDLIB
    from .data.tokenize import tokenize
    inputs = [*args.inputs, *([STDLIB] if args.stdlib else [])]
    result = tokenize(inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      eval_fraction=args.eval_fraction, text_field=args.text_field)
    print(result.summary(), flush=True)
    return 0


# ---------------------------------------------------------------- generate

def _bounded_number(kind: type, what: str, minimum: float, *, above: bool = False) -> Any:
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


def _add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``: the checkpoint that generate and quantize read."""
    parser.add_argument("--model", required=True, type=Path, metavar="DIR",
                        help="checkpoint directory with config.json and model.safetensors, or "
                             "a tierflow train --out directory (its latest step_N)")


def _add_generate(sub: Any) -> None:
    """Register ``tierflow generate`` (the work is in tierflow.generate)."""
    from .generate_options import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
    gen = sub.add_parser(
        "generate", help="sample text from a checkpoint with a KV cache",
        description="Load a causal LM directory (config.json, model.safetensors, tokenizer.json; "
                    "e.g. OUT/step_N from tierflow train), print the prompt and stream the "
                    "continuation, sampled token by token with a KV cache, then a line with "
                    "tokens/s. An int8 copy written by tierflow quantize loads the same way.")
    _add_checkpoint_argument(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    gen.add_argument("--max-new-tokens", type=_bounded_number(int, "tokens to generate", 1),
                     default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                     help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    gen.add_argument("--temperature", type=_bounded_number(float, "0 is greedy", 0.0),
                     default=DEFAULT_TEMPERATURE, metavar="F",
                     help=f"sampling temperature; 0 picks the most likely token "
                          f"(default {DEFAULT_TEMPERATURE})")
    gen.add_argument("--top-k", type=_bounded_number(int, "the K most likely tokens", 1), default=None,
                     metavar="K", help="sample among the K most likely tokens only")
    gen.add_argument("--seed", type=_bounded_number(int, "a random seed", 0), default=None, metavar="N",
                     help="random seed: the same seed gives the same text (default: random)")
    gen.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                     help="tokenizer.json or a directory holding one (default DIR/tokenizer.json)")
    gen.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                     help="weights and compute dtype (auto: bf16 where the CPU has native bf16)")
    gen.add_argument("--ram", default=None, metavar="SIZE",
                     help="RAM budget, e.g. 1GiB: below what the whole model needs, decoder "
                          "layers are read from the checkpoint for every token (the plan is "
                          "printed on stderr); refused, naming the smallest budget, when even "
                          "that does not fit")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the prompt and its continuation to stdout, then the tokens/s line."""
    from .generate_options import check_request
    request = dict(tokenizer=args.tokenizer, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, ram=args.ram)
    check_request(args.model, args.prompt, **request)  # bad input fails before torch loads
    from .generate import run
    run(args.model, args.prompt, seed=args.seed, dtype=args.dtype, **request)
    return 0


def _add_quantize(sub: Any) -> None:
    """Register ``tierflow quantize`` (the work is in tierflow.quantize)."""
    q = sub.add_parser(
        "quantize", help="copy a checkpoint with int8 linear weights, for generate",
        description="Write a copy of a checkpoint whose linear layers hold int8 weights with "
                    "one scale per output channel (half of bf16's bytes), read one tensor at a "
                    "time. tierflow generate reads it (faster, and fewer bytes per token when "
                    "it streams under --ram); the text differs slightly from the original's. "
                    "Training refuses it.")
    _add_checkpoint_argument(q)
    q.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="the new directory to write (never overwritten)")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Write the int8 copy; bad input fails before torch loads."""
    from .generate_options import check_new_directory, checkpoint_directory
    directory = checkpoint_directory(args.model)
    check_new_directory(args.out)
    from .quantize import quantize_checkpoint
    quantize_checkpoint(directory, args.out)
    return 0


# ---------------------------------------------------------------- plot

def _add_plot(sub: Any) -> None:
    """Register ``tierflow plot`` (the work is in tierflow.plot)."""
    plot = sub.add_parser(
        "plot", help="draw a training log: loss, tokens/s, memory per tier",
        description="Read the JSONL log of tierflow train (--log) and draw train and eval loss "
                    "against steps and tokens, tokens/s, and memory per tier into one image.")
    plot.add_argument("log", type=Path, metavar="LOG.jsonl", help="the training log")
    plot.add_argument("-o", "--out", type=Path, default=None, metavar="FILE",
                      help="image to write: .png, .pdf, .svg, ... (default LOG with .png)")
    plot.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """Read the log, write the figure, print a one-line summary."""
    from .plot import plot_run, read_log
    log = read_log(args.log)
    out = args.out if args.out is not None else args.log.with_suffix(".png")
    plot_run(log, out)
    print(log.summary(out), flush=True)
    return 0


# ---------------------------------------------------------------- train

def _add_train(sub: Any) -> None:
    """Register ``tierflow train`` (options in tierflow.train.options, the loop in .loop)."""
    from .train.option_flags import add_arguments
    train = sub.add_parser(
        "train", help="train a causal LM on token files inside a memory budget",
        description="Train a preset (random init) or a local Hugging Face model on the token "
                    "files of 'tierflow tokenize', planned by tierflow under --ram; evaluate, "
                    "checkpoint (every --save-every steps, at the end, on Ctrl-C) and resume "
                    "exactly. Any flag can also come from --config FILE.toml; flags win.")
    add_arguments(train)
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from .torchrun_env import world_size_from_env
    from .train.option_flags import from_args
    from .train.preflight import preflight
    opts = from_args(args)
    preflight(opts)  # bad input fails here, before the seconds of importing torch
    from .distributed import exit_rank
    from .train.loop import train
    code = train(opts)
    if world_size_from_env() > 1:  # a torchrun rank whose run is over: see exit_rank
        exit_rank(code)
    return code


# ---------------------------------------------------------------- entry point

def _is_user_error(err: BaseException) -> bool:
    """A ValueError that tierflow raised: its class or the frame that raised it is tierflow's."""
    if not isinstance(err, ValueError):
        return False
    if type(err).__module__.split(".")[0] == "tierflow":
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = str(Path(__file__).resolve().parent)
    return tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(package)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if not _is_user_error(err) or os.environ.get("TIERFLOW_TRACEBACK"):
            raise
        _fail(str(err))
        return 2  # not reached


if __name__ == "__main__":
    sys.exit(main())
