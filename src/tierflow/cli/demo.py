"""``tierflow demo``: the LLM workflow, offline, on the Python standard library's source.

It tokenizes the source (a byte-level BPE trained on it), trains a small Llama under a RAM
budget with evaluation, saves the checkpoint, samples from it and plots the run, each phase
with a header line, all by calling the functions behind ``tokenize``, ``train``,
``generate`` and ``plot``. ``--quick`` is the same on a subset of the files with a tiny model
(a test in under a minute).

``--sft`` is instruction tuning instead: question/answer pairs made from the standard library's
docstrings ("What does json.dumps do?" and the first sentence of its docstring,
``data/stdlib_qa.py``) written as chat JSONL, a model directory whose tokenizer carries a
ChatML chat template, the records tokenized through it (the loss on the answers only),
trained, evaluated on the held-out answers with ``tierflow eval``'s function and asked
questions with ``generate --chat``'s.
"""
from __future__ import annotations

import argparse
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .args import positive_int, size_text

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
# --sft: a Llama of about 3M parameters trained on the docstring answers ("small"), or the
# tiny one with --quick; the tokenizer a byte-level BPE of the records' text
SFT_FULL = DemoSettings(files=None, vocab_size=2048, model="small", seq_len=256, batch_size=8,
                        steps=300, eval_every=50, eval_steps=8, lr=2e-3, ram="1GiB",
                        max_new_tokens=48)
SFT_QUICK = DemoSettings(files=None, vocab_size=512, model="tiny", seq_len=128, batch_size=8,
                         steps=60, eval_every=20, eval_steps=4, lr=3e-3, ram="512MiB",
                         max_new_tokens=32)
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SFT_QUESTIONS = ("What does json.dumps do?", "What does os.path.join do?",
                 "What does math.sqrt do?", "What does shutil.copy do?")
SFT_EVAL_FRACTION = 0.05  # of the conversations, held out in eval.bin


def register(sub: Any) -> None:
    """Add ``tierflow demo`` to the subcommands ``sub``."""
    demo = sub.add_parser(
        "demo", help="the LLM workflow on the Python standard library, offline, in minutes",
        description="Tokenize the Python standard library's source (a byte-level BPE trained on "
                    "it), train a small Llama on it under a RAM budget with evaluation, save the "
                    "checkpoint, sample from it after a prompt ending in 'def ' and plot the run. "
                    "Everything goes to --out; token files already there are reused.")
    demo.add_argument("--out", type=Path, default=None, metavar="DIR",
                      help="where the token files, checkpoint, log, plot and sample go "
                           "(default runs/demo; runs/demo-sft with --sft)")
    demo.add_argument("--steps", type=positive_int, default=None, metavar="N",
                      help="training steps (default 400, --sft 300; 60 with --quick)")
    demo.add_argument("--ram", type=size_text, default=None, metavar="SIZE",
                      help="RAM budget of the training step (default 1GiB; 512MiB with --quick)")
    demo.add_argument("--quick", action="store_true",
                      help="a tiny Llama on 60 stdlib files with a 512-id vocab: under a minute")
    demo.add_argument("--sft", action="store_true",
                      help="instruction tuning instead: chat records of questions on the "
                           "stdlib's functions answered by their docstrings' first sentence, "
                           "tokenized through a ChatML chat template, trained with the loss "
                           "on the answers only, then tierflow eval on the held-out answers "
                           "and generate --chat")
    demo.set_defaults(func=run)


def _train(model: str, data: Path, root: Path, settings: DemoSettings) -> int:
    """``tierflow train`` of ``model`` on ``data`` with the demo's settings, its checkpoints
    and log under ``root``; its exit code."""
    from ..train.loop import train
    from ..train.options import TrainOptions
    values = dict(model=model, data=str(data), ram=settings.ram, seq_len=settings.seq_len,
                  batch_size=settings.batch_size, steps=settings.steps, lr=settings.lr,
                  eval_every=settings.eval_every, eval_steps=settings.eval_steps,
                  out=str(root), log=str(root / "log.jsonl"))
    return train(TrainOptions(**values, given=frozenset(values)).validate())


def _header(number: int, title: str, out: TextIO) -> None:
    print(f"\n=== [{number}/5] {title}", file=out, flush=True)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``tierflow demo``: tokenize, train, save, generate, plot; print where everything is
    (``--sft``: ``run_sft``)."""
    import sys
    out = out if out is not None else sys.stdout
    sft = getattr(args, "sft", False)
    base = (SFT_QUICK if args.quick else SFT_FULL) if sft else (QUICK if args.quick else FULL)
    settings = DemoSettings(**{**base.__dict__,
                               "steps": args.steps or base.steps,
                               "ram": args.ram or base.ram})
    root = Path(args.out) if args.out is not None else Path("runs/demo-sft" if sft
                                                            else "runs/demo")
    if args.quick:  # a tiny model gains nothing from threads, and a busy machine makes them thrash
        import torch
        torch.set_num_threads(1)
    if sft:
        return run_sft(settings, root, out)
    start = time.perf_counter()
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
        from ..data.tokenize import tokenize
        result = tokenize(inputs, data, vocab_size=settings.vocab_size, log=out)
        print(result.summary(), file=out, flush=True)

    _header(2, f"train {_model_words(settings)} under --ram {settings.ram}", out)
    model = settings.model
    if model == "tiny":
        model = str(_write_tiny_model(root / "tiny-init", data))
    code = _train(model, data, root, settings)
    if code != 0:
        return code
    checkpoint = root / f"step_{settings.steps}"

    _header(3, "the checkpoint", out)
    files = sorted(p.name for p in checkpoint.iterdir())
    print(f"{checkpoint}: {', '.join(files)}", file=out)
    print("loads as it is with transformers.AutoModelForCausalLM.from_pretrained; continue "
          f"training with: tierflow train --resume {checkpoint} --steps N", file=out, flush=True)

    _header(4, f"generate from the prompt {PROMPT!r} (temperature 0.8, top-k 40, seed 0)", out)
    from ..generate.options import GenerateRequest
    from ..generate.sample import run as generate
    text = _Tee(out)
    generate(GenerateRequest.of(checkpoint, PROMPT, max_new_tokens=settings.max_new_tokens,
                                temperature=0.8, top_k=40, seed=0), out=text)
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


def run_sft(settings: DemoSettings, root: Path, out: TextIO) -> int:
    """``tierflow demo --sft``: write the docstring questions as chat JSONL, make a model
    directory whose tokenizer has a chat template, tokenize the records through it (answers
    as targets), train, evaluate the held-out answers before and after, ask questions."""
    from ..data.stdlib_qa import qa_pairs, write_chat_jsonl
    from ..data.tokenize import tokenize
    from ..train.data_dir import open_token_file
    from ..train.evaluate import evaluate_files
    from ..train.options import TrainOptions

    start = time.perf_counter()
    print(f"tierflow demo --sft (instruction tuning {_model_words(settings)} on questions "
          f"about the Python standard library) -> {root}", file=out, flush=True)

    _header(1, "chat records from the standard library's docstrings", out)
    root.mkdir(parents=True, exist_ok=True)
    pairs = qa_pairs()
    records = write_chat_jsonl(pairs, root / "qa.jsonl")
    print(f"{records}: {len(pairs):,} conversations, e.g. {pairs[1][0]!r} -> "
          f"{pairs[1][1]!r}", file=out, flush=True)

    _header(2, "a model directory with a chat template; tokenize through it", out)
    model = _write_chat_model(root / "init", [q + "\n" + a for q, a in pairs], settings)
    print(f"{model}: a new {_model_words(settings).split(' (')[0]} whose tokenizer_config.json "
          "has a ChatML chat template (end token <|im_end|>)", file=out, flush=True)
    data = root / "data"
    if data.exists():
        import shutil
        shutil.rmtree(data)  # the tokenizer is new each time: tokenize again
    result = tokenize([records], data, tokenizer=model, eval_fraction=SFT_EVAL_FRACTION,
                      seq_len=settings.seq_len, truncate=True, log=out)
    print(result.summary(), file=out, flush=True)

    _header(3, f"train on the answers only under --ram {settings.ram}", out)
    code = _train(str(model), data, root, settings)
    if code != 0:
        return code
    checkpoint = root / f"step_{settings.steps}"

    _header(4, f"tierflow eval --model {checkpoint} {data / 'eval.bin'}", out)
    losses = []
    for which in (model, checkpoint):
        opts = dict(model=str(which), data=str(data), ram=settings.ram,
                    seq_len=settings.seq_len, batch_size=settings.batch_size)
        (evaluation,) = evaluate_files(TrainOptions(**opts, given=frozenset(opts)),
                                       [open_token_file(data / "eval.bin")], log=io.StringIO())
        losses.append(evaluation.loss)
        print(("before: " if which == model else "after:  ") + evaluation.line(), file=out,
              flush=True)

    questions, held_out = _questions(pairs)
    _header(5, "generate --chat (greedy): " + "; ".join(repr(q) for q in questions), out)
    from ..generate.options import GenerateRequest
    from ..generate.sample import run as generate
    text = _Tee(out)
    for question in questions:
        text.write(f"> {question}{' (held out)' if question == held_out else ''}\n")
        generate(GenerateRequest.of(checkpoint, question, max_new_tokens=settings.max_new_tokens,
                                    temperature=0, seed=0, chat=True), out=text)
    sample = root / "sample.txt"
    sample.write_text(text.getvalue(), encoding="utf-8")

    elapsed = time.perf_counter() - start
    print(f"\ndone in {elapsed / 60:.1f} min ({elapsed:.0f} s)", file=out)
    print(f"  held-out answer loss {losses[0]:.3f} -> {losses[1]:.3f}", file=out)
    for name, path in (("chat records", records), ("token files", data),
                       ("checkpoint", checkpoint), ("training log", root / "log.jsonl"),
                       ("sample", sample)):
        print(f"  {name:<13} {path}", file=out)
    print(f"next: tierflow generate --model {checkpoint} --chat --prompt 'What does "
          "shutil.copy do?'", file=out, flush=True)
    return 0


def _questions(pairs: list[tuple[str, str]]) -> tuple[list[str], str | None]:
    """The questions the demo asks: those of ``SFT_QUESTIONS`` that were trained on, then the
    first whose conversation tokenize held out in eval.bin (its split is seeded), if any."""
    from ..data.tokenize import eval_indices
    held = eval_indices(len(pairs), SFT_EVAL_FRACTION)
    trained = {q for i, (q, _) in enumerate(pairs) if i not in held}
    asked = [q for q in SFT_QUESTIONS if q in trained]
    held_out = next((pairs[i][0] for i in sorted(held)), None)
    return asked + ([held_out] if held_out else []), held_out


def _write_chat_model(directory: Path, texts: list[str], settings: DemoSettings) -> Path:
    """A randomly initialised Llama (``TINY`` or ``SMALL``) saved as a model directory with
    an instruct model's tokenizer files: a byte-level BPE of ``texts`` with the ChatML special
    tokens, a tokenizer_config.json with the chat template and <|im_end|> as its eos token,
    and a generation_config.json that ends generation there."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from ..data.tokenizer import train_tokenizer
    tok = train_tokenizer(texts, settings.vocab_size)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    end = tok.token_to_id("<|im_end|>")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "clean_up_tokenization_spaces": False}, indent=1), encoding="utf-8")
    shape = TINY if settings.model == "tiny" else SMALL
    config = LlamaConfig(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=end)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _model_words(settings: DemoSettings) -> str:
    name = {"tiny": "a tiny Llama", "small": "a small Llama"}.get(settings.model, settings.model)
    return (f"{name} ({settings.steps} steps of {settings.batch_size} x {settings.seq_len} "
            f"tokens, eval every {settings.eval_every})")


def _inputs(settings: DemoSettings) -> list[str]:
    """The tokenize INPUTs: ``stdlib``, or its first ``files`` files (for --quick)."""
    from ..data import STDLIB
    if settings.files is None:
        return [STDLIB]
    from ..data.corpus import stdlib_corpus
    return [str(p) for p in stdlib_corpus()[:settings.files]]


def _data_is_valid(data: Path, inputs: list[str], vocab_size: int) -> bool:
    """Whether ``data`` holds complete token files of ``inputs`` with a ``vocab_size`` BPE:
    meta.json is written last, so its presence with the same inputs and vocab means reuse."""
    from ..data.tokenize import describe_input
    try:
        meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
        from ..train.data_dir import open_data
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
