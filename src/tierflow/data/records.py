"""Records of a structured INPUT of ``tierflow tokenize``: ``.jsonl`` (one JSON object a line),
``.json`` (an array of objects), ``.parquet`` and ``.csv`` (the formats Hugging Face datasets
are stored in), read with the standard library's ``json`` and with ``pyarrow``.

Each record is a dict with its place (``file:line`` or ``file:row N``) for error messages.
What a record holds (chat, prompt/completion, text) is ``examples.py``'s business; here a
Parquet or CSV file is only checked to have the columns one of those kinds needs, before any
slow work.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ..core.errors import TierflowError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_BATCH_ROWS = 1024


def is_record_file(path: Path) -> bool:
    """Whether ``path`` holds records (by its suffix) rather than one text document."""
    return path.suffix.lower() in RECORD_SUFFIXES


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, record) for every record of ``path``, in order; a record is normally a dict."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path)
    elif suffix == ".json":
        yield from _json_array(path)
    else:
        for number, record in enumerate(_arrow_rows(path), 1):
            yield f"{path}:row {number}", record


def columns(path: Path) -> list[str] | None:
    """The column names of a Parquet or CSV file (None for JSON, whose records say)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return list(_parquet(path).schema_arrow.names)
    if suffix == ".csv":
        return list(_csv(path).schema.names)
    return None


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise TierflowError(f"{where} is not valid JSON ({err.msg}); fix: one JSON "
                                    f"object per line") from None


def _json_array(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise TierflowError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); fix: "
                            f"a JSON array of objects, or one object a line in a .jsonl "
                            f"file") from None
    if not isinstance(data, list):
        raise TierflowError(f"{path} holds a JSON {type(data).__name__}, not an array of "
                            f"records; fix: a JSON array of objects, or a .jsonl file")
    for number, record in enumerate(data, 1):
        yield f"{path}:record {number}", record


def _arrow_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a Parquet or CSV file as dicts, read in batches (not all in memory)."""
    if path.suffix.lower() == ".parquet":
        batches = _parquet(path).iter_batches(batch_size=_BATCH_ROWS)
    else:
        batches = _csv(path)  # a streaming reader: batch by batch
    for batch in batches:
        yield from batch.to_pylist()


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise TierflowError(f"INPUT {path} cannot be read as Parquet ({_reason(err)}); fix: "
                            f"give a Parquet file, or rename it to its real format") from None


def _csv(path: Path) -> Any:
    import pyarrow.csv as pcsv
    try:  # every column a string: a CSV's text must not become numbers or dates
        probe = pcsv.open_csv(path)
        types = {name: "string" for name in probe.schema.names}
        return pcsv.open_csv(path, convert_options=pcsv.ConvertOptions(column_types=types))
    except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise TierflowError(f"INPUT {path} cannot be read as CSV ({_reason(err)}); fix: give "
                            f"a CSV file with a header row") from None


def _reason(err: Exception) -> str:
    return " ".join(str(err).split())[:160]
