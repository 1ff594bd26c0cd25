"""The ``tierflow`` command line. ``tierflow demo`` for now; train, plan, ... come later.

Every user error (a bad flag, a bad size, a budget no plan fits) is printed as one line
``tierflow: error: ...`` on stderr with exit code 2, never as a traceback. Set
``TIERFLOW_TRACEBACK=1`` to see the traceback anyway.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import measure
from .config import PLANNERS
from .units import format_bytes, parse_bytes

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
    demo = sub.add_parser(
        "demo", help="fit a small Llama under a RAM budget; compare with plain PyTorch",
        description="Fit a small Llama-style model (random weights, random tokens) under a RAM "
                    "budget, print the plan, then measure plain PyTorch and tierflow, each in a "
                    "fresh process: peak RSS above the post-import baseline, median step time, "
                    "tokens/s and the loss of every step.")
    demo.add_argument("--ram", type=_size, default=None, metavar="SIZE",
                      help="tierflow's RAM budget, e.g. 600MiB (default: half of plain "
                           "PyTorch's measured peak)")
    demo.add_argument("--arch", choices=sorted(measure.ARCHS), default=None,
                      help="model size (default llama-20m; llama-tiny with --quick)")
    demo.add_argument("--seq", type=_positive_int, default=None, help="sequence length (default 512)")
    demo.add_argument("--batch", type=_positive_int, default=None, help="batch size (default 4)")
    demo.add_argument("--steps", type=_positive_int, default=None,
                      help="timed steps after one warm-up step (default 3)")
    demo.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                      help="bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16)")
    demo.add_argument("--planner", choices=PLANNERS, default="auto",
                      help="tierflow's planner (default auto: keep-all when it fits, else rotor)")
    demo.add_argument("--quick", action="store_true",
                      help="a tiny model and short sequences: a smoke test in seconds")
    demo.set_defaults(func=cmd_demo)
    _add_tokenize(sub)
    _add_train(sub)
    _add_generate(sub)
    _add_plot(sub)
    return parser


def _version() -> str:
    from . import __version__
    return __version__


# ---------------------------------------------------------------- demo

def cmd_demo(args: argparse.Namespace) -> int:
    quick = args.quick
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if measure.fast_bf16() else "fp32")
    workload = measure.Workload(
        arch=args.arch or ("llama-tiny" if quick else "llama-20m"),
        seq=args.seq or (128 if quick else 512), batch=args.batch or (2 if quick else 4),
        steps=args.steps or (2 if quick else 3), dtype=dtype)
    print(f"tierflow demo: {workload.describe()}")
    print("each configuration runs in a fresh process; peak RSS is measured above the RSS "
          "right after imports", flush=True)

    _progress("plain PyTorch")
    plain = measure.measure(workload, "plain")
    _done(plain)
    budget, chosen = args.ram, "--ram"
    if budget is None:
        budget, chosen = plain["peak_above_baseline_bytes"] // 2, "half of plain PyTorch's peak"
    _progress(f"tierflow under ram={format_bytes(budget)} ({chosen})")
    fitted = measure.measure(workload, "tierflow", ram=budget, planner=args.planner)
    if fitted["status"] == "infeasible":
        if args.ram is not None or not fitted.get("smallest"):
            raise measure.ChildUserError(fitted["error"])
        print(f"\n  {fitted['error']}\n  -> using the smallest budget that fits instead")
        budget = int(fitted["smallest"])
        _progress(f"tierflow under ram={format_bytes(budget)} (the smallest feasible budget)")
        fitted = measure.measure(workload, "tierflow", ram=budget, planner=args.planner)
        if fitted["status"] == "infeasible":
            raise measure.ChildUserError(fitted["error"])
    _done(fitted)
    print()
    print(fitted["explain"])
    print()
    print(comparison_table(plain, fitted, budget))
    return 0


def _progress(what: str) -> None:
    print(f"  measuring {what} ...", end="", flush=True)
    _progress.start = time.perf_counter()  # type: ignore[attr-defined]


def _done(record: dict[str, Any]) -> None:
    print(f" done in {time.perf_counter() - _progress.start:.0f} s", flush=True)  # type: ignore[attr-defined]


def comparison_table(plain: dict[str, Any], fitted: dict[str, Any], budget: int) -> str:
    """Plain PyTorch next to tierflow: peak, step time, tok/s, losses; predictions vs measured."""
    rows = [("", "peak RSS above baseline", "median step", "tok/s", "loss per step")]
    for name, r in (("plain PyTorch", plain), ("tierflow", fitted)):
        peak = format_bytes(r["peak_above_baseline_bytes"])
        if r is fitted:
            peak += f" ({r['peak_above_baseline_bytes'] / budget:.0%} of the {format_bytes(budget)} budget)"
        rows.append((name, peak, f"{r['step_s_median']:.3f} s", f"{r['tok_s']:,.0f}",
                     " ".join(f"{x:.4f}" for x in r["losses"])))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    pred_peak, pred_time = fitted["predicted_peak_bytes"], fitted["predicted_step_s"]
    lines.append("")
    lines.append(f"tierflow predicted peak {format_bytes(pred_peak)} "
                 f"({_err(pred_peak, fitted['peak_above_baseline_bytes'])} vs measured), "
                 f"predicted step {pred_time:.3f} s ({_err(pred_time, fitted['step_s_median'])}); "
                 f"fit took {fitted['fit_s']:.1f} s")
    diff = max(abs(a - b) for a, b in zip(plain["losses"], fitted["losses"]))
    ratio = fitted["step_s_median"] / plain["step_s_median"]
    saved = 1 - fitted["peak_above_baseline_bytes"] / plain["peak_above_baseline_bytes"]
    lines.append(f"tierflow uses {abs(saved):.0%} {'less' if saved >= 0 else 'more'} memory than plain "
                 f"PyTorch at {ratio:.2f}x its step time; "
                 f"losses differ by at most {diff:.1e}")
    return "\n".join(lines)


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


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


def _add_generate(sub: Any) -> None:
    """Register ``tierflow generate`` (the work is in tierflow.generate)."""
    from .generate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
    gen = sub.add_parser(
        "generate", help="sample text from a checkpoint with a KV cache",
        description="Load a causal LM directory (config.json, model.safetensors, tokenizer.json; "
                    "e.g. OUT/step_N from tierflow train), print the prompt and stream the "
                    "continuation, sampled token by token with a KV cache, then a line with "
                    "tokens/s.")
    gen.add_argument("--model", required=True, type=Path, metavar="DIR",
                     help="checkpoint directory with config.json and model.safetensors")
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
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the prompt and its continuation to stdout, then the tokens/s line."""
    from .generate import run
    run(args.model, args.prompt, tokenizer=args.tokenizer, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, seed=args.seed, dtype=args.dtype)
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
    from .train.options import add_arguments
    train = sub.add_parser(
        "train", help="train a causal LM on token files inside a memory budget",
        description="Train a preset (random init) or a local Hugging Face model on the token "
                    "files of 'tierflow tokenize', planned by tierflow under --ram; evaluate, "
                    "checkpoint (every --save-every steps, at the end, on Ctrl-C) and resume "
                    "exactly. Any flag can also come from --config FILE.toml; flags win.")
    add_arguments(train)
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from .train.loop import train
    from .train.options import from_args
    return train(from_args(args))


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
