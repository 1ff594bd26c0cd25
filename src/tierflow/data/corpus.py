"""Collect documents from the INPUT paths of ``tierflow tokenize``.

A text file is one document; each record of a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv``
file is one (``records.py`` reads them, ``examples.py`` says what a record holds: a chat, a
prompt/completion pair or its ``text_field``). Directories are walked recursively in sorted order (hidden entries skipped);
files inside them that are binary or not UTF-8 are skipped and counted, while a binary file
named explicitly is an error, since the user clearly meant it. The embedded default corpus is
the Python standard library's own source, which every Python installation has offline.
"""
from __future__ import annotations

import codecs
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..core.errors import TierflowError
from . import STDLIB
from .examples import TEXT, Example, check_columns, example_of
from .records import columns, is_record_file, read_records

_SNIFF_BYTES = 8192
_READ_BYTES = 1 << 20
_SITE_DIRS = {"site-packages", "dist-packages"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_corpus(include_tests: bool = False) -> list[Path]:
    """The ``*.py`` files of the standard library (the directory of ``os.py``), sorted.

    Installed packages (``site-packages``) are left out so that the corpus is the same on every
    installation of one Python version; the large test suites are left out unless asked for.
    """
    root = Path(os.__file__).resolve().parent
    skip = _SITE_DIRS | (set() if include_tests else _TEST_DIRS)
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts[:-1]) and p.is_file())


@dataclass
class Corpus:
    """The files behind a set of INPUTs, and how to read their documents.

    ``files`` are the readable text and JSONL files, ``skipped`` the binary or non-UTF-8 files
    found in directories. Documents are read lazily (see :meth:`documents`), so a corpus larger
    than memory can be read twice: once to train a tokenizer, once to encode.
    """

    inputs: list[str]
    files: list[Path]
    skipped: list[Path] = field(default_factory=list)
    text_field: str = "text"

    def examples(self) -> Iterator[Example]:
        """Every non-empty document, in a fixed order (files sorted, records in order)."""
        for path in self.files:
            if is_record_file(path):
                for where, record in read_records(path):
                    example = example_of(record, where, self.text_field)
                    if example is not None:
                        yield example
            else:
                text = _read_text(path)
                if text and text.strip():
                    yield Example(TEXT, str(path), text=text)

    def documents(self) -> Iterator[str]:
        """Every non-empty document's text (what a tokenizer is trained on)."""
        for example in self.examples():
            yield example.plain_text()

    def count_documents(self) -> dict[str, int]:
        """The number of documents of each kind; reads the corpus once and validates every
        record."""
        counts: dict[str, int] = {}
        for example in self.examples():
            counts[example.kind] = counts.get(example.kind, 0) + 1
        return counts


def collect(inputs: Sequence[str | os.PathLike[str]], text_field: str = "text") -> Corpus:
    """The corpus of ``inputs``: files, directories (recursive), ``.jsonl`` files, or ``stdlib``.

    Raises TierflowError for a missing or unreadable INPUT, an explicitly named binary file,
    or a corpus with no text file at all.
    """
    if not inputs:
        raise TierflowError("no INPUT given; fix: name text files, directories or .jsonl "
                            "files, or 'stdlib' for the Python standard library's source")
    files: list[Path] = []
    skipped: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if str(raw) == STDLIB and not path.exists():
            files.extend(stdlib_corpus())
        elif path.is_dir():
            found, binary = _walk(path)
            files.extend(found)
            skipped.extend(binary)
        else:
            files.append(_explicit_file(path))
    for path in files:
        names = columns(path) if is_record_file(path) else None
        if names is not None:
            check_columns(path, names, text_field)
    if not files:
        note = f" ({len(skipped)} binary or non-UTF-8 files skipped)" if skipped else ""
        raise TierflowError(f"the corpus is empty: no text files in {', '.join(map(str, inputs))}"
                            f"{note}; fix: name text files, directories of text files or "
                            f".jsonl, .json, .parquet or .csv files")
    return Corpus([str(i) for i in inputs], files, skipped, text_field)


def _explicit_file(path: Path) -> Path:
    """A file named on the command line: it must exist, be readable and be text."""
    if not path.exists():
        raise TierflowError(f"INPUT {path} does not exist; fix: check the path")
    if not path.is_file() or not os.access(path, os.R_OK):
        raise TierflowError(f"INPUT {path} is not a readable file or directory; fix: check its "
                            f"type and permissions")
    problem = None if path.suffix.lower() == ".parquet" else _binary_problem(path)
    if problem:
        raise TierflowError(f"INPUT {path} is not text: {problem}; fix: pass UTF-8 text, .jsonl "
                            f"or a directory")
    return path


def _walk(root: Path) -> tuple[list[Path], list[Path]]:
    """Text and binary files under ``root``, recursively, sorted; hidden entries are ignored."""
    if not os.access(root, os.R_OK | os.X_OK):
        raise TierflowError(f"INPUT directory {root} is not readable; fix: check its permissions")
    text: list[Path] = []
    binary: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(folder, name)
            if name.startswith(".") or not path.is_file():
                continue
            parquet = path.suffix.lower() == ".parquet"
            (binary if not parquet and _binary_problem(path) else text).append(path)
    return text, binary


def _binary_problem(path: Path) -> str | None:
    """Why ``path`` is not UTF-8 text (NUL bytes, a decoding error), or None when it is.

    Decodes in chunks, so checking a file of many GiB needs little memory.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ_BYTES):
                if offset == 0 and b"\0" in chunk[:_SNIFF_BYTES]:
                    return "it contains NUL bytes (a binary file)"
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    byte, where = err.object[err.start], offset + err.start
                    return f"byte {byte:#04x} near offset {where} is not UTF-8"
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "it ends inside a UTF-8 character"
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    return None


def _read_text(path: Path) -> str:
    """The file decoded as UTF-8 (a leading byte-order mark dropped)."""
    return path.read_bytes().decode("utf-8-sig")
