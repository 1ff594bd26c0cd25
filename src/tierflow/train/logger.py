"""What ``tierflow train`` prints and logs: sections, one ``[T]`` line per step, ``[V]`` lines,
a progress bar on a terminal (only), and every record as one JSON line in the log file."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import TierflowError
from ..units import format_bytes

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


def plan_section(plan: Any, *, grads: int, budget: int | None, grad_accum: int,
                 dist: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The ``[Plan]`` table (bytes per kind, the strategy, the predicted step) and the fields
    of its JSON record. Under torchrun ``dist`` holds ``world_size``, ``backend``,
    ``bus_bandwidth`` (bytes/s), ``comm_bytes`` and ``predicted_comm_s``; every figure is
    this rank's (budgets are per rank)."""
    extra = plan.costs.extra
    activations = max(0, plan.simulation.peak - grads)
    kinds = [("parameters", extra.get("parameters", 0)), ("gradients", grads),
             ("optimizer states (reserved)", extra.get("reserved", 0)),
             ("activations", activations), ("runtime", extra.get("runtime", 0))]
    rows: list[tuple[str, Any]] = [(k, format_bytes(v)) for k, v in kinds]
    if dist is not None:
        rows[2] = (f"optimizer states (reserved, 1/{dist['world_size']} shard)", rows[2][1])
    rows.append(("total (predicted peak)", format_bytes(plan.predicted_peak)))
    free = (f"{format_bytes(budget - plan.predicted_peak)} of the {format_bytes(budget)} "
            "budget" if budget else "- (no --ram budget)")
    step = (f"{plan.predicted_time * grad_accum * 1e3:.0f} ms ({grad_accum} x "
            f"{plan.predicted_time * 1e3:.0f} ms forward+backward, optimizer not included)")
    rows += [("free", free), ("strategy", plan.strategy), ("predicted step", step)]
    fields: dict[str, Any] = {k: int(v) for k, v in kinds}
    fields.update(predicted_peak=int(plan.predicted_peak), budget=budget,
                  strategy=plan.strategy, predicted_step_s=plan.predicted_time * grad_accum)
    if dist is not None:
        n = dist["world_size"]
        parallel = (f"{n} ranks ({dist['backend']}); ZeRO-2: AdamW moments and reduced "
                    f"gradients sharded 1/{n}, parameters all-gathered after each update")
        comm = (f"{dist['predicted_comm_s'] * 1e3:.2f} ms per step predicted "
                f"({format_bytes(dist['comm_bytes'])} x {n - 1}/{n} at "
                f"{format_bytes(dist['bus_bandwidth'])}/s bus bandwidth, measured at start)")
        rows += [("data parallel", parallel), ("communication", comm)]
        fields.update({k: v for k, v in dist.items() if k != "comm_bytes"})
    return section("Plan", rows), fields


class Logger:
    """Prints to ``out`` (stdout) and appends JSON records to ``log_path`` (flushed per line).
    The progress bar goes to stderr and only when stderr is a terminal. An inactive logger
    (ranks other than 0 under torchrun) prints and writes nothing."""

    def __init__(self, log_path: Path, *, out: TextIO | None = None, append: bool = False,
                 active: bool = True):
        self.out = out or sys.stdout
        self.bar_stream = sys.stderr
        self.tty = self.bar_stream.isatty()
        self._bar_shown = False
        self.path = log_path
        self.active = active
        self.file = None
        if not active:
            return
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(log_path, "a" if append else "w", encoding="utf-8")
        except OSError as e:
            raise TierflowError(f"cannot write the log {log_path} ({e.strerror}): use --log or "
                                "--out with a writable path") from None

    def record(self, kind: str, **fields: Any) -> None:
        if self.file is None:
            return
        fields = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.file.write(json.dumps(fields, default=str) + "\n")
        self.file.flush()

    def print(self, text: str = "") -> None:
        if not self.active:
            return
        self._clear_bar()
        print(text, file=self.out, flush=True)

    def bar(self, step: int, total: int, seconds_per_step: float) -> None:
        if not self.active or not self.tty or total <= 0:
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
        if self.file is not None:
            self.file.close()
