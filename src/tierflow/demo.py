"""``tierflow demo`` (the embedded default of the LLM workflow) and ``tierflow compare``.

``tierflow demo`` runs the whole workflow offline on the Python standard library's source:
tokenize it (a byte-level BPE trained on it), train a small Llama under a RAM budget with
evaluation, save the checkpoint, sample from it and plot the run, each phase with a header
line, all by calling the functions behind ``tokenize``, ``train``, ``generate`` and ``plot``.
``--quick`` is the same on a subset of the files with a tiny model (a test in under a minute).

``tierflow compare`` (the first demo of the project) fits a small Llama on random tokens under
a budget and measures plain PyTorch and tierflow side by side, each in a fresh process.
"""
from __future__ import annotations

import argparse
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from . import measure
from .profile.machine import default_matmul_dtype
from .units import format_bytes

PROMPT = "import os\n\n\ndef "  # a module's start: "def " alone often ends the document at once


@dataclass(frozen=True)
class DemoSettings:
    """What the demo trains: the corpus, the tokenizer's vocab, the model and the run."""

    files: int | None  # the first N files of the stdlib corpus; None: all of it
    vocab_size: int
    model: str  # a preset, or "tiny" for a small Llama written by the demo itself
    seq_len: int
    batch_size: int
    steps: int
    eval_every: int
    eval_steps: int
    lr: float
    ram: str
    max_new_tokens: int


FULL = DemoSettings(files=None, vocab_size=4096, model="llama-20m", seq_len=256, batch_size=8,
                    steps=400, eval_every=50, eval_steps=8, lr=1e-3, ram="1GiB",
                    max_new_tokens=120)
QUICK = DemoSettings(files=60, vocab_size=512, model="tiny", seq_len=128, batch_size=8,
                     steps=60, eval_every=20, eval_steps=4, lr=3e-3, ram="512MiB",
                     max_new_tokens=40)
# the tiny Llama of --quick (about 0.2M parameters with a 512-id vocab)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512)


def _header(number: int, title: str, out: TextIO) -> None:
    print(f"\n=== [{number}/5] {title}", file=out, flush=True)


def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``tierflow demo``: tokenize, train, save, generate, plot; print where everything is."""
    import sys
    out = out if out is not None else sys.stdout
    base = QUICK if args.quick else FULL
    settings = DemoSettings(**{**base.__dict__,
                               "steps": args.steps or base.steps,
                               "ram": args.ram or base.ram})
    root = Path(args.out)
    start = time.perf_counter()
    if args.quick:  # a tiny model gains nothing from threads, and a busy machine makes them thrash
        import torch
        torch.set_num_threads(1)
    what = "quick: a tiny Llama on a subset of" if args.quick else "a small Llama on"
    print(f"tierflow demo ({what} the Python standard library's source) -> {root}", file=out,
          flush=True)

    _header(1, "tokenize the Python standard library", out)
    data = root / "data"
    inputs = _inputs(settings)
    if _data_is_valid(data, inputs, settings.vocab_size):
        meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
        print(f"reusing {data}: {meta['train_tokens']:,} train and {meta['eval_tokens']:,} eval "
              f"tokens, vocab {meta['vocab_size']:,} (delete it to tokenize again)", file=out,
              flush=True)
    else:
        from .data.tokenize import tokenize
        result = tokenize(inputs, data, vocab_size=settings.vocab_size, log=out)
        print(result.summary(), file=out, flush=True)

    _header(2, f"train {_model_words(settings)} under --ram {settings.ram}", out)
    model = settings.model
    if model == "tiny":
        model = str(_write_tiny_model(root / "tiny-init", data))
    from .train.loop import train
    from .train.options import TrainOptions
    values = dict(model=model, data=str(data), ram=settings.ram, seq_len=settings.seq_len,
                  batch_size=settings.batch_size, steps=settings.steps, lr=settings.lr,
                  eval_every=settings.eval_every, eval_steps=settings.eval_steps,
                  out=str(root), log=str(root / "log.jsonl"))
    code = train(TrainOptions(**values, given=frozenset(values)).validate())
    if code != 0:
        return code
    checkpoint = root / f"step_{settings.steps}"

    _header(3, "the checkpoint", out)
    files = sorted(p.name for p in checkpoint.iterdir())
    print(f"{checkpoint}: {', '.join(files)}", file=out)
    print("loads as it is with transformers.AutoModelForCausalLM.from_pretrained; continue "
          f"training with: tierflow train --resume {checkpoint} --steps N", file=out, flush=True)

    _header(4, f"generate from the prompt {PROMPT!r} (temperature 0.8, top-k 40, seed 0)", out)
    from .generate import run as generate
    text = _Tee(out)
    generate(checkpoint, PROMPT, max_new_tokens=settings.max_new_tokens, temperature=0.8,
             top_k=40, seed=0, out=text)
    sample = root / "sample.txt"
    sample.write_text(text.getvalue(), encoding="utf-8")

    _header(5, "plot the run", out)
    from .plot import plot_run, read_log
    log = read_log(root / "log.jsonl")
    png = plot_run(log, root / "run.png")
    print(log.summary(png), file=out, flush=True)

    evals = [r["loss"] for r in log.eval]
    elapsed = time.perf_counter() - start
    print(f"\ndone in {elapsed / 60:.1f} min ({elapsed:.0f} s)", file=out)
    if evals:
        print(f"  eval loss     {evals[0]:.3f} (step {log.eval[0]['step']}) -> {evals[-1]:.3f} "
              f"(step {log.eval[-1]['step']})", file=out)
    for name, path in (("token files", data), ("checkpoint", checkpoint),
                       ("training log", root / "log.jsonl"), ("plot", png), ("sample", sample)):
        print(f"  {name:<13} {path}", file=out)
    print(f"next: tierflow generate --model {checkpoint} --prompt 'class '", file=out, flush=True)
    return 0


def _model_words(settings: DemoSettings) -> str:
    name = "a tiny Llama" if settings.model == "tiny" else settings.model
    return (f"{name} ({settings.steps} steps of {settings.batch_size} x {settings.seq_len} "
            f"tokens, eval every {settings.eval_every})")


def _inputs(settings: DemoSettings) -> list[str]:
    """The tokenize INPUTs: ``stdlib``, or its first ``files`` files (for --quick)."""
    from .data import STDLIB
    if settings.files is None:
        return [STDLIB]
    from .data.corpus import stdlib_corpus
    return [str(p) for p in stdlib_corpus()[:settings.files]]


def _data_is_valid(data: Path, inputs: list[str], vocab_size: int) -> bool:
    """Whether ``data`` holds complete token files of ``inputs`` with a ``vocab_size`` BPE:
    meta.json is written last, so its presence with the same inputs and vocab means reuse."""
    from .data.tokenize import describe_input
    try:
        meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
        from .train.data_dir import open_data
        open_data(data)
    except Exception:  # missing, half-written or foreign: tokenize again
        return False
    return (meta.get("inputs") == [describe_input(i) for i in inputs]
            and meta.get("tokenizer", {}).get("vocab_size_requested") == vocab_size)


def _write_tiny_model(directory: Path, data: Path) -> Path:
    """A randomly initialised tiny Llama saved as a model directory (config.json and
    model.safetensors) that ``tierflow train --model DIR`` trains."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
    config = LlamaConfig(vocab_size=int(meta["vocab_size"]), tie_word_embeddings=False,
                         bos_token_id=meta["eot_id"], eos_token_id=meta["eot_id"], **TINY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class _Tee(io.StringIO):
    """A text stream that also writes through to ``out`` (the generated sample)."""

    def __init__(self, out: TextIO):
        super().__init__()
        self._out = out

    def write(self, text: str) -> int:
        self._out.write(text)
        return super().write(text)

    def flush(self) -> None:
        self._out.flush()


# ---------------------------------------------------------------- compare

def run_compare(args: argparse.Namespace) -> int:
    """``tierflow compare``: plain PyTorch, then tierflow under the budget, in fresh processes."""
    quick = args.quick
    dtype = args.dtype if args.dtype != "auto" else default_matmul_dtype()
    workload = measure.Workload(
        arch=args.arch or ("llama-tiny" if quick else "llama-20m"),
        seq=args.seq or (128 if quick else 512), batch=args.batch or (2 if quick else 4),
        steps=args.steps or (2 if quick else 3), dtype=dtype)
    print(f"tierflow compare: {workload.describe()}")
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
