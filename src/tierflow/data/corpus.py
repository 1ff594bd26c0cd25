"""Collect documents from the INPUT paths of ``tierflow tokenize``.

A text file is one document; each line of a ``.jsonl`` file is one document (its
``text_field``). Directories are walked recursively in sorted order (hidden entries skipped);
files inside them that are binary or not UTF-8 are skipped and counted, while a binary file
named explicitly is an error, since the user clearly meant it. The embedded default corpus is
the Python standard library's own source, which every Python installation has offline.
"""
from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import TierflowError
from . import STDLIB

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

    def documents(self) -> Iterator[str]:
        """Every non-empty document, in a fixed order (files sorted, JSONL lines in order)."""
        for path in self.files:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, self.text_field)
            else:
                text = _read_text(path)
                if text and text.strip():
                    yield text

    def count_documents(self) -> int:
        """The number of documents; reads the corpus once and validates every JSONL line."""
        return sum(1 for _ in self.documents())


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
    if not files:
        note = f" ({len(skipped)} binary or non-UTF-8 files skipped)" if skipped else ""
        raise TierflowError(f"the corpus is empty: no text files in {', '.join(map(str, inputs))}"
                            f"{note}; fix: name text files, directories of text files or "
                            f".jsonl files")
    return Corpus([str(i) for i in inputs], files, skipped, text_field)


def _explicit_file(path: Path) -> Path:
    """A file named on the command line: it must exist, be readable and be text."""
    if not path.exists():
        raise TierflowError(f"INPUT {path} does not exist; fix: check the path")
    if not path.is_file() or not os.access(path, os.R_OK):
        raise TierflowError(f"INPUT {path} is not a readable file or directory; fix: check its "
                            f"type and permissions")
    problem = _binary_problem(path)
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
            (binary if _binary_problem(path) else text).append(path)
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


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` of every line of a JSONL file; blank lines and empty texts are skipped."""
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TierflowError(f"{where} is not valid JSON ({err.msg}); fix: one JSON object "
                                    f"per line") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = (", ".join(sorted(record)) if isinstance(record, dict)
                        else f"a {type(record).__name__}")
                raise TierflowError(f"{where} has no field {text_field!r} (found: {keys}); fix: "
                                    f"name the text field with --text-field")
            text = record[text_field]
            if not isinstance(text, str):
                raise TierflowError(f"{where}: field {text_field!r} is a "
                                    f"{type(text).__name__}, not a string; fix: name the text "
                                    f"field with --text-field")
            if text.strip():
                yield text
