"""``tierflow tokenize``: a corpus in, token files, a tokenizer and a summary out.

Steps: collect the INPUT files (:mod:`tierflow.data.corpus`) and count their documents, which
also validates every record before any slow work; load a tokenizer (and, for chat records, its
chat template) or train a byte-level BPE on the corpus; encode every document (text followed
by an end-of-text token; chat and prompt/completion records with a loss mask, ``examples.py``),
sending a seeded random ``eval_fraction`` of the documents to ``eval.bin`` and the rest to
``train.bin``, each document's boundaries recorded. The token files are written first, then the
tokenizer; ``DIR/meta.json`` is written last and the old one removed first, so its presence
means the files beside it are complete and belong together. A bad record leaves a directory
that did not exist before uncreated.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

import numpy as np
from tokenizers import Tokenizer

from ..core.errors import TierflowError
from ..core.files import write_text_atomically
from . import DEFAULT_EVAL_FRACTION, DEFAULT_VOCAB_SIZE, STDLIB
from .corpus import Corpus, collect
from .examples import CHAT, TEXT, ChatTemplate, encode_example
from .tokenfile import TokenWriter, dtype_for_vocab
from .tokenizer import (
    TOKENIZER_FILES,
    end_of_text,
    load_tokenizer,
    tokenizer_file,
    train_tokenizer,
    vocab_hash,
)

MIN_VOCAB_SIZE = 257  # 256 byte tokens + the end-of-text token
MAX_VOCAB_SIZE = 1 << 20
SPLIT_SEED = 0
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20


@dataclass
class TokenizeResult:
    """What ``tokenize`` wrote: counts per split, the vocab, the end-of-text token, timing."""

    out: str
    documents: int
    train_documents: int
    eval_documents: int
    train_tokens: int
    eval_tokens: int
    vocab_size: int
    bytes_per_token: int
    eot_token: str
    eot_id: int
    files: int
    skipped_files: int
    seconds: float
    tokenizer: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)  # documents of each kind
    masked: bool = False  # the token files carry a loss mask
    vocab_hash: str = ""  # tokenizer.vocab_hash: training compares it with the model's
    truncated: int = 0  # documents cut to --seq-len

    def summary(self) -> str:
        """One line for the end of the command's output."""
        total = self.train_tokens + self.eval_tokens
        return (f"tierflow tokenize: {self.documents:,} documents from {self.files:,} files"
                f"{_skipped_note(self.skipped_files)} -> {total:,} tokens "
                f"(train {self.train_tokens:,} in {self.train_documents:,} documents, eval "
                f"{self.eval_tokens:,} in {self.eval_documents:,}), vocab {self.vocab_size:,}, "
                f"{self.seconds:.1f} s -> {self.out}")


def tokenize(inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
             tokenizer: str | os.PathLike[str] | None = None, vocab_size: int | None = None,
             eval_fraction: float = DEFAULT_EVAL_FRACTION, text_field: str = "text",
             seq_len: int | None = None, truncate: bool = False,
             log: TextIO | None = None) -> TokenizeResult:
    """Tokenize ``inputs`` into ``out``/{train.bin, eval.bin, tokenizer files, meta.json}.

    ``tokenizer`` is a ``tokenizer.json`` or a model directory holding one (its chat template
    renders chat records); without it a byte-level BPE of ``vocab_size`` (default 8192) ids is
    trained on the corpus. ``inputs`` may contain ``"stdlib"``: the Python standard library's
    source. A document longer than ``seq_len`` tokens is refused, or cut with ``truncate``.
    Progress goes to ``log`` (stderr).
    """
    start = time.perf_counter()
    log = sys.stderr if log is None else log
    _check_options(tokenizer, vocab_size, eval_fraction)
    corpus = collect(inputs, text_field)
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    out = Path(out)
    _check_out(out)
    kinds = _count_documents(corpus)
    template = _template(kinds, tokenizer)
    what = ", ".join(f"{n:,} {kind}" for kind, n in sorted(kinds.items()))
    _note(log, f"read {len(corpus.files):,} files: {sum(kinds.values()):,} documents ({what})"
               + _skipped_note(len(corpus.skipped)))
    if given is None:
        tok, origin = _train(corpus, sum(kinds.values()), vocab_size, log)
    else:
        tok, origin = given, {"kind": "file", "path": str(Path(str(tokenizer)).resolve())}
    encoding = Encoding(tok, template, kinds, seq_len, truncate)
    created = not out.exists()
    try:
        return _write_outputs(out, corpus, encoding, origin, tokenizer, eval_fraction, start,
                              log)
    except OSError as err:
        raise TierflowError(f"cannot write {err.filename or out}: {err.strerror}; fix: free "
                            f"disk space or choose another --out") from None
    except TierflowError:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a bad record: nothing written
        raise


@dataclass
class Encoding:
    """How documents become token files: the tokenizer, the chat template (chat records),
    the kinds of documents, and the length limit."""
    tok: Tokenizer
    template: ChatTemplate | None
    kinds: dict[str, int]
    seq_len: int | None
    truncate: bool
    truncated: int = 0

    @property
    def masked(self) -> bool:
        """Whether some tokens are context only (chat or prompt/completion records)."""
        return any(kind != TEXT for kind in self.kinds)

    def limited(self, ids: np.ndarray, mask: np.ndarray | None, where: str
                ) -> tuple[np.ndarray, np.ndarray | None]:
        """A document within ``seq_len`` tokens: cut with ``truncate``, else refused."""
        if self.seq_len is None or len(ids) <= self.seq_len:
            return ids, mask
        if not self.truncate:
            raise TierflowError(f"{where} is {len(ids):,} tokens long, more than --seq-len "
                                f"{self.seq_len}; fix: raise --seq-len, pass --truncate to cut "
                                f"such records, or drop the record")
        self.truncated += 1
        return ids[:self.seq_len], None if mask is None else mask[:self.seq_len]


def _count_documents(corpus: Corpus) -> dict[str, int]:
    """Count (and so validate) the documents of each kind; an all-empty corpus is an error."""
    kinds = corpus.count_documents()
    if not kinds:
        raise TierflowError(f"the corpus is empty: {len(corpus.files)} files but no non-empty "
                            f"document in {', '.join(corpus.inputs)}; fix: add text")
    return kinds


def _template(kinds: dict[str, int], tokenizer: str | os.PathLike[str] | None
              ) -> ChatTemplate | None:
    """The chat template that chat records need: the given model directory's."""
    if CHAT not in kinds:
        return None
    if tokenizer is None:
        raise TierflowError(f"{kinds[CHAT]:,} chat records need the model's chat template; fix: "
                            f"tokenize with --tokenizer MODEL_DIR (the model's own directory)")
    return ChatTemplate(tokenizer)


def _train(corpus: Corpus, n_docs: int, vocab_size: int | None,
           log: TextIO) -> tuple[Tokenizer, dict[str, Any]]:
    """Train the default tokenizer on the corpus; returns it and its origin for meta.json."""
    size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    _note(log, f"training a byte-level BPE tokenizer (vocab {size:,}) ...")
    tok = train_tokenizer(corpus.documents(), size, n_docs, progress=_isatty(log))
    return tok, {"kind": "trained", "algorithm": "byte-level BPE", "vocab_size_requested": size}


def _write_outputs(out: Path, corpus: Corpus, encoding: Encoding, origin: dict[str, Any],
                   source: str | os.PathLike[str] | None, eval_fraction: float, start: float,
                   log: TextIO) -> TokenizeResult:
    """Write the token files, the tokenizer and, last, meta.json."""
    tok = encoding.tok
    n_docs = sum(encoding.kinds.values())
    eot, eot_id, added = end_of_text(tok, source)
    origin["eot_added"] = added
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    eval_docs = eval_indices(n_docs, eval_fraction)
    single_fraction = eval_fraction if n_docs == 1 else 0.0
    counts = _encode(corpus, encoding, eot_id, eval_docs, single_fraction, n_docs, out, log)
    _save_tokenizer(tok, out, source, eot, added)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    result = TokenizeResult(
        out=str(out), documents=n_docs, train_documents=n_docs - len(eval_docs),
        eval_documents=len(eval_docs), train_tokens=counts[0], eval_tokens=counts[1],
        vocab_size=vocab, bytes_per_token=dtype_for_vocab(vocab).itemsize, eot_token=eot,
        eot_id=eot_id, files=len(corpus.files), skipped_files=len(corpus.skipped),
        seconds=time.perf_counter() - start, tokenizer=origin, kinds=dict(encoding.kinds),
        masked=encoding.masked, vocab_hash=vocab_hash(tok), truncated=encoding.truncated)
    _write_json(out / "meta.json", _meta(result, corpus, eval_fraction, bool(single_fraction),
                                         encoding.seq_len))
    return result


# ---------------------------------------------------------------- checks

def _check_options(tokenizer: object, vocab_size: int | None, eval_fraction: float) -> None:
    """Reject contradictory or out-of-range options before reading anything."""
    if tokenizer is not None and vocab_size is not None:
        raise TierflowError("--tokenizer and --vocab-size exclude each other: a given tokenizer "
                            "has its own vocab; fix: drop one of them")
    if vocab_size is not None and not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise TierflowError(f"--vocab-size {vocab_size} is outside [{MIN_VOCAB_SIZE}, "
                            f"{MAX_VOCAB_SIZE}] (256 bytes + end-of-text at least); fix: pick "
                            f"a size in that range, e.g. {DEFAULT_VOCAB_SIZE}")
    if not 0 <= eval_fraction < 1:
        raise TierflowError(f"--eval-fraction {eval_fraction} is outside [0, 1); fix: a fraction "
                            f"of the documents such as {DEFAULT_EVAL_FRACTION}")


def _check_out(out: Path) -> None:
    """``out`` is a writable directory or can be created as one, checked before any work."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise TierflowError(f"--out {out} cannot be a directory: {existing} is a file; fix: "
                            f"choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TierflowError(f"--out {out} is not writable ({existing} denies writing); fix: "
                            f"choose a directory you can write to")


# ---------------------------------------------------------------- tokenizers

def _save_tokenizer(tok: Tokenizer, out: Path, source: str | os.PathLike[str] | None,
                    eot: str, added: bool) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` that transformers' AutoTokenizer reads.

    A given model directory's tokenizer files are copied (chat template and all) unless the
    end-of-text token had to be added, in which case they would not describe the saved
    tokenizer.
    """
    write_text_atomically(out / "tokenizer.json", tok.to_str(), durable=True)
    directory = tokenizer_file(Path(source)).parent if source is not None else None
    beside = [directory / name for name in TOKENIZER_FILES[1:]] if directory else []
    if directory is not None and not added and (directory / "tokenizer_config.json").is_file():
        for path in beside:
            if path.is_file() and path.name != "generation_config.json":
                shutil.copyfile(path, out / path.name)
    else:
        _write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot,
            "unk_token": eot, "clean_up_tokenization_spaces": False})


# ---------------------------------------------------------------- encoding

def eval_indices(n_documents: int, fraction: float, seed: int = SPLIT_SEED) -> set[int]:
    """Which documents go to eval: a seeded random ``fraction``, at least one, never all.

    With a single document none is chosen; :func:`_encode` then splits its tokens instead.
    """
    if fraction <= 0 or n_documents < 2:
        return set()
    count = min(n_documents - 1, max(1, round(n_documents * fraction)))
    rng = np.random.default_rng(seed)
    return {int(i) for i in rng.choice(n_documents, size=count, replace=False)}


def _encode(corpus: Corpus, encoding: Encoding, eot_id: int, eval_docs: set[int],
            single_fraction: float, n_docs: int, out: Path, log: TextIO) -> tuple[int, int]:
    """Encode every document into train.bin and eval.bin; returns their token counts.

    ``single_fraction`` > 0 splits a lone document: its last tokens go to eval.
    """
    vocab = encoding.tok.get_vocab_size(with_added_tokens=True)
    progress = Progress("encoding", n_docs, log)
    tokens = 0
    masked = encoding.masked
    with TokenWriter(out / "train.bin", vocab, masked) as train, \
            TokenWriter(out / "eval.bin", vocab, masked) as ev:
        for index, (ids, mask, where) in enumerate(_encoded(corpus, encoding, eot_id)):
            ids, mask = encoding.limited(ids, mask, where)
            if single_fraction:
                cut = len(ids) - max(1, round(len(ids) * single_fraction))
                train.write(ids[:cut], None if mask is None else mask[:cut])
                ev.write(ids[cut:], None if mask is None else mask[cut:])
            else:
                (ev if index in eval_docs else train).write(ids, mask)
            tokens += len(ids)
            progress.update(index + 1, tokens)
        progress.close()
    return train.count, ev.count


def _encoded(corpus: Corpus, encoding: Encoding, eot_id: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray | None, str]]:
    """(ids, loss mask, where) of each document: plain text followed by ``eot_id`` and
    encoded in batches (in parallel, in Rust), with no mask; records with a mask one by one
    (``examples.encode_example``)."""
    if encoding.masked:
        for example in corpus.examples():
            ids, mask = encode_example(example, encoding.tok, eot_id, encoding.template)
            yield ids, mask, example.where
        return
    batch: list[str] = []
    places: list[str] = []
    chars = 0
    for example in corpus.examples():
        batch.append(example.text)
        places.append(example.where)
        chars += len(example.text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            for ids, where in zip(_encode_batch(batch, encoding.tok, eot_id), places):
                yield ids, None, where
            batch, places, chars = [], [], 0
    for ids, where in zip(_encode_batch(batch, encoding.tok, eot_id), places):
        yield ids, None, where


def _encode_batch(batch: list[str], tok: Tokenizer, eot_id: int) -> Iterator[np.ndarray]:
    for encoding in tok.encode_batch_fast(batch, add_special_tokens=False):
        ids = np.empty(len(encoding.ids) + 1, dtype=np.int64)
        ids[:-1] = encoding.ids
        ids[-1] = eot_id
        yield ids


# ---------------------------------------------------------------- output

class Progress:
    """Documents done out of a total, on ``stream``: a bar redrawn in place on a terminal,
    otherwise one plain line at each quarter (logs stay short)."""

    def __init__(self, label: str, total: int, stream: TextIO):
        self.label, self.total, self.stream = label, max(total, 1), stream
        self.tty = _isatty(stream)
        self.start = self.last_draw = time.perf_counter()
        self.quarter = 0

    def update(self, done: int, tokens: int) -> None:
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw >= 0.1 or done == self.total:
                self.last_draw = now
                self.stream.write("\r" + self._line(done, tokens, now, bar=True))
                self.stream.flush()
        elif done * 4 >= (self.quarter + 1) * self.total:
            self.quarter = done * 4 // self.total
            _note(self.stream, self._line(done, tokens, now, bar=False))

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, done: int, tokens: int, now: float, bar: bool) -> str:
        fraction = done / self.total
        shown = f"[{'#' * round(30 * fraction):<30}] " if bar else ""
        elapsed = now - self.start
        rate = f", {tokens / elapsed:,.0f} tok/s" if elapsed > 0 else ""
        return (f"  {self.label} {shown}{fraction:4.0%} {done:,}/{self.total:,} documents, "
                f"{tokens:,} tokens, {elapsed:.0f} s{rate}")


def _skipped_note(count: int) -> str:
    return f" ({count} non-text file{'s' if count != 1 else ''} skipped)" if count else ""


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _note(stream: TextIO, line: str) -> None:
    print(line, file=stream, flush=True)


def _meta(result: TokenizeResult, corpus: Corpus, eval_fraction: float,
          split_tokens: bool, seq_len: int | None) -> dict[str, Any]:
    """meta.json: everything a trainer or a person needs to know about the token files."""
    return {
        "format": "tierflow token files", "dtype": str(dtype_for_vocab(result.vocab_size)),
        **asdict(result),
        "train": "train.bin", "eval": "eval.bin", "tokenizer_file": "tokenizer.json",
        "eval_fraction": eval_fraction,
        "split": ("the last tokens of the single document" if split_tokens
                  else f"random documents, seed {SPLIT_SEED}"),
        "text_field": corpus.text_field, "seq_len": seq_len,
        "inputs": [describe_input(i) for i in corpus.inputs],
        "skipped_examples": [str(p) for p in corpus.skipped[:10]],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def describe_input(raw: str) -> str:
    """An INPUT as an absolute path, or ``stdlib (DIR)`` for the embedded corpus."""
    if raw == STDLIB and not Path(raw).exists():
        return f"{STDLIB} ({Path(os.__file__).resolve().parent})"
    return str(Path(raw).resolve())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomically(path, json.dumps(data, indent=2) + "\n", durable=True)
