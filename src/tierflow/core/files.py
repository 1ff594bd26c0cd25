"""Files replaced at once: written under a temporary name beside the target, then renamed
over it, so that a reader (another process, a run stopped midway) sees the old file or the
new one, never half of either."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s new content to; it replaces ``path``
    when the block ends, and is removed when the block raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` with ``text`` at once; ``durable``: on the disk before the rename
    (fsync), so that a crash leaves the old file rather than an empty new one."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
