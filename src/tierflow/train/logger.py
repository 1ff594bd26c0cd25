"""What ``tierflow train`` prints and logs: sections, one ``[T]`` line per step, ``[V]`` lines,
a progress bar on a terminal (only), and every record as one JSON line in the log file."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import TierflowError

GIB = 2 ** 30


def format_rate(tok_s: float) -> str:
    """``35.1k`` tokens per second (``k``/``M`` suffixes, three significant digits)."""
    if tok_s >= 1e6:
        return f"{tok_s / 1e6:.1f}M"
    if tok_s >= 1e3:
        return f"{tok_s / 1e3:.1f}k"
    return f"{tok_s:.0f}"


def train_line(*, step: int, total: int, ms: float, norm: float, loss: float, tok_s: float,
               sol: float | None, ram_bytes: int | None, budget: int | None) -> str:
    """``[T] step 12 [ 3.1%] | 1869 ms | norm 4.31 | loss 3.282 | 35.1k tok/s | sol 42.9% |
    ram 3.1/4.0 GiB``."""
    pct = 100.0 * step / total if total else 100.0
    sol_text = f"{100 * sol:.1f}%" if sol is not None else "-"
    ram = "-" if ram_bytes is None else f"{ram_bytes / GIB:.1f}"
    ram += f"/{budget / GIB:.1f} GiB" if budget else "/- GiB"
    return (f"[T] step {step} [{pct:4.1f}%] | {ms:.0f} ms | norm {norm:.2f} | loss {loss:.3f} | "
            f"{format_rate(tok_s)} tok/s | sol {sol_text} | ram {ram}")


def eval_line(*, step: int, loss: float, ppl: float, ms: float) -> str:
    return f"[V] step {step} | eval loss {loss:.3f} | ppl {ppl:.2f} | {ms:.0f} ms"


def section(title: str, rows: list[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([f"[{title}]"] + [f"  {k.ljust(width)} : {v}" for k, v in rows])


class Logger:
    """Prints to ``out`` (stdout) and appends JSON records to ``log_path`` (flushed per line).
    The progress bar goes to stderr and only when stderr is a terminal."""

    def __init__(self, log_path: Path, *, out: TextIO | None = None, append: bool = False):
        self.out = out or sys.stdout
        self.bar_stream = sys.stderr
        self.tty = self.bar_stream.isatty()
        self._bar_shown = False
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(log_path, "a" if append else "w", encoding="utf-8")
        except OSError as e:
            raise TierflowError(f"cannot write the log {log_path} ({e.strerror}): use --log or "
                                "--out with a writable path") from None
        self.path = log_path

    def record(self, kind: str, **fields: Any) -> None:
        fields = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.file.write(json.dumps(fields, default=str) + "\n")
        self.file.flush()

    def print(self, text: str = "") -> None:
        self._clear_bar()
        print(text, file=self.out, flush=True)

    def bar(self, step: int, total: int, seconds_per_step: float) -> None:
        if not self.tty or total <= 0:
            return
        width = 30
        done = int(width * step / total)
        eta = max(0.0, (total - step) * seconds_per_step)
        text = f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} eta {eta:.0f} s"
        self.bar_stream.write(text)
        self.bar_stream.flush()
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.bar_stream.write("\r\033[K")
            self.bar_stream.flush()
            self._bar_shown = False

    def close(self) -> None:
        self._clear_bar()
        self.file.close()
