"""Question/answer pairs made from the Python standard library's docstrings, offline: "What
does json.dumps do?" answered by the first sentence of its docstring. ``tierflow demo --sft``
fine-tunes on them as chat records (``{"messages": [user, assistant]}``)."""
from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Iterable

# modules whose public functions have one-sentence docstrings worth answering with
MODULES = ("json", "os", "os.path", "shutil", "glob", "fnmatch", "textwrap", "string", "re",
           "math", "cmath", "statistics", "random", "itertools", "functools", "operator",
           "heapq", "bisect", "copy", "base64", "binascii", "zlib", "gzip", "difflib",
           "calendar", "time", "datetime", "html", "urllib.parse", "shlex", "keyword",
           "unicodedata", "struct", "pickle", "tempfile", "inspect", "tokenize", "ast",
           "platform", "sysconfig", "colorsys", "secrets", "hashlib", "uuid", "codecs")
_SIGNATURE = re.compile(r"^[\w.]+\(")  # a C function's docstring that opens with its signature


def first_sentence(doc: str | None) -> str | None:
    """The first sentence of a docstring's first paragraph, on one line; None when there is
    none of a useful length (20 to 200 characters) or the docstring opens with a signature."""
    if not doc:
        return None
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    if _SIGNATURE.match(paragraph):
        return None
    end = re.search(r"[.!?](\s|$)", paragraph)
    sentence = paragraph[:end.end()].strip() if end else paragraph
    if not 20 <= len(sentence) <= 200 or not sentence[0].isupper():
        return None
    return sentence if sentence[-1] in ".!?" else sentence + "."


def qa_pairs(modules: Iterable[str] = MODULES) -> list[tuple[str, str]]:
    """(question, answer) of every public function of ``modules`` with a usable docstring,
    in module then name order; one per function object (aliases once)."""
    pairs, seen = [], set()
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module this build of Python lacks (e.g. zlib)
            continue
        for name in sorted(vars(module)):
            obj = vars(module)[name]
            if name.startswith("_") or id(obj) in seen or not (
                    inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            answer = first_sentence(inspect.getdoc(obj))
            if answer is None:
                continue
            seen.add(id(obj))
            pairs.append((f"What does {module_name}.{name} do?", answer))
    return pairs


def write_chat_jsonl(pairs: list[tuple[str, str]], path: Path) -> Path:
    """``pairs`` as chat records, one conversation of a user question and the assistant's
    answer a line."""
    with open(path, "w", encoding="utf-8") as f:
        for question, answer in pairs:
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path
