"""``tierflow plot LOG.jsonl -o run.png``: a 2x2 figure of a training run's JSONL log.

Panels: train and eval loss against steps (tokens on the top axis), the same against tokens,
throughput (tokens/s) against steps, and memory per tier against steps (with each tier's
budget as a dashed line when the log gives one).

The log: one JSON object per line. The reader is tolerant: blank lines, lines that are not
JSON objects (a line cut short when a run was killed), records of other kinds (``"config"``,
``"plan"``, ...) and unknown fields are skipped; only the fields below are read, and all but
``step`` and the loss are optional. When a step appears twice (a resumed run appended to the
same log), the later record wins.

Train records, ``{"kind": "train", ...}`` (a record without ``kind`` that has ``loss`` counts
as one):

- ``step`` (int, required): the optimizer step, from 1;
- ``loss`` (float, required): the training loss of the step;
- ``tokens`` (int): tokens trained on so far, this step included;
- ``tok_s`` (float): tokens per second of the step;
- memory in bytes, any of: ``"mem": {"ram": int, "gpu": int, "disk": int, ...}`` (any tier
  name), or top-level ``ram_bytes``, ``gpu_bytes``, ... (``<tier>_bytes``); the value
  plotted is what the step used or held at its peak in that tier;
- budgets in bytes, any of: ``"budget": {"ram": int, ...}``, ``"budget": int`` (the RAM
  budget; ``null`` or 0 for none) or ``<tier>_budget_bytes``, also read from records of any
  other kind (the run's ``plan`` record); the ``plan`` record's ``predicted_peak`` (bytes,
  RAM) is drawn as a dotted line.

Eval records, ``{"kind": "eval", ...}`` (a record without ``kind`` that has ``eval_loss``
counts as one):

- ``step`` (int, required): the step after which the evaluation ran;
- ``eval_loss`` (float, required; ``loss`` is accepted too): the mean evaluation loss;
- ``tokens`` (int): tokens trained on so far; when missing, taken from the train record of
  the same step (or interpolated between train steps).

Example lines::

    {"kind": "train", "step": 12, "tokens": 49152, "loss": 3.282, "tok_s": 35100.0,
     "ms": 1869.0, "norm": 4.31, "mem": {"ram": 3328599654}, "budget": {"ram": 4294967296}}
    {"kind": "eval", "step": 50, "tokens": 204800, "eval_loss": 3.41}

``read_log(path) -> RunLog`` reads; ``plot_run(log_or_path, out) -> Path`` draws (matplotlib
with the Agg canvas, no display needed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import TierflowError
from ..core.files import replacing

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn
    from matplotlib.figure import Figure

TRAIN, EVAL = "train", "eval"


@dataclass
class RunLog:
    """The records of one log, sorted by step, one per step."""

    path: str
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    budgets: dict[str, int] = field(default_factory=dict)
    skipped_lines: int = 0  # blank lines not counted
    other_records: int = 0
    predicted_peak: int | None = None  # the plan's predicted RAM peak, bytes

    def summary(self, out: str | os.PathLike[str]) -> str:
        skipped = f", {self.skipped_lines} unreadable lines skipped" if self.skipped_lines else ""
        return (f"tierflow plot: {len(self.train)} train and {len(self.eval)} eval records from "
                f"{self.path}{skipped} -> {out}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _memory(record: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """({tier: bytes used}, {tier: budget bytes}) of one record."""
    mem: dict[str, float] = {}
    budget: dict[str, float] = {}
    for key, value in record.items():
        if not key.endswith("_bytes"):
            continue
        number = _number(value)
        if number is None:
            continue
        if key.endswith("_budget_bytes"):
            budget[key[: -len("_budget_bytes")]] = number
        else:
            mem[key[: -len("_bytes")]] = number
    single = _number(record.get("budget"))
    if single is not None and single > 0:
        budget["ram"] = single
    for name, target in (("mem", mem), ("budget", budget)):
        nested = record.get(name)
        if isinstance(nested, dict):
            for tier, value in nested.items():
                number = _number(value)
                if number is not None:
                    target[str(tier)] = number
    return mem, budget


def _kind(record: dict[str, Any]) -> str | None:
    kind = record.get("kind")
    if kind in (TRAIN, EVAL):
        return kind
    if kind is None:
        if "eval_loss" in record:
            return EVAL
        if "loss" in record and "step" in record:
            return TRAIN
    return None


def read_log(path: str | os.PathLike[str]) -> RunLog:
    """Read a tierflow training log (the fields in this module's docstring)."""
    path = Path(path)
    if not path.exists():
        raise TierflowError(f"log {path} does not exist: pass the JSONL file given to "
                            "tierflow train --log")
    if not path.is_file():
        raise TierflowError(f"log {path} is not a file: pass the JSONL file given to "
                            "tierflow train --log")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise TierflowError(f"log {path} cannot be read ({err.strerror}): check its "
                            "permissions") from None
    log = RunLog(path=str(path))
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    kinds: set[str] = set()
    lines = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        lines += 1
        try:
            record = json.loads(line)
        except ValueError:
            log.skipped_lines += 1
            continue
        if not isinstance(record, dict):
            log.skipped_lines += 1
            continue
        mem, budget = _memory(record)
        log.budgets.update({k: int(v) for k, v in budget.items()})
        predicted = _number(record.get("predicted_peak"))
        if record.get("kind") == "plan" and predicted is not None and predicted > 0:
            log.predicted_peak = int(predicted)
        kind = _kind(record)
        step = record.get("step")
        if kind is None:
            log.other_records += 1
            kinds.add(str(record.get("kind")))
            continue
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
            log.skipped_lines += 1
            continue
        loss = _number(record.get("eval_loss" if kind == EVAL else "loss"))
        if loss is None and kind == EVAL:
            loss = _number(record.get("loss"))
        row = {"step": int(step), "loss": loss, "tokens": _number(record.get("tokens")),
               "tok_s": _number(record.get("tok_s")), "mem": mem}
        (train if kind == TRAIN else evals)[int(step)] = row
    if lines == 0:
        raise TierflowError(f"log {path} is empty: run tierflow train --log {path} first (or "
                            "wait for its first step)")
    if not train:
        found = ", ".join(sorted(kinds | ({EVAL} if evals else set()))) or "none"
        raise TierflowError(f"log {path} has no train records ({lines} lines; kinds found: "
                            f"{found}; {log.skipped_lines} unreadable): expected JSON lines with "
                            '"kind": "train", "step" and "loss" as tierflow train --log writes')
    log.train = [train[s] for s in sorted(train)]
    log.eval = [evals[s] for s in sorted(evals)]
    _fill_eval_tokens(log)
    return log


def _fill_eval_tokens(log: RunLog) -> None:
    """Give eval records without ``tokens`` the train tokens at their step (interpolated)."""
    known = [(r["step"], r["tokens"]) for r in log.train if r["tokens"] is not None]
    if not known:
        return
    import numpy as np
    steps, tokens = np.array([k[0] for k in known]), np.array([k[1] for k in known])
    for record in log.eval:
        if record["tokens"] is None:
            record["tokens"] = float(np.interp(record["step"], steps, tokens))


def _byte_unit(peak: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= scale:
            return unit, float(scale)
    return "bytes", 1.0


def _series(records: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    pairs = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="gray")


def _label(ax: Any, title: str | None, xlabel: str, ylabel: str) -> None:
    """A panel's title (None: set elsewhere), axis labels and light grid."""
    if title is not None:
        ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _loss_panel(ax: Any, log: RunLog, x: str, xlabel: str) -> None:
    tx, ty = _series(log.train, "loss", x)
    ex, ey = _series(log.eval, "loss", x)
    if not tx and not ex:
        _empty(ax, f"no {x} counts in the log")
    if tx:
        ax.plot(tx, ty, color="tab:blue", linewidth=1, label="train loss")
    if ex:
        ax.plot(ex, ey, color="tab:orange", marker="o", markersize=4, linewidth=1.5,
                label="eval loss")
    _label(ax, None, xlabel, "loss (nats/token)")
    if tx or ex:
        ax.legend()


def _extend(x, y):
    """``x``, ``y`` with a point far out at each end on the line of the end segments, so that
    ``np.interp`` extrapolates linearly instead of clamping (ticks past the data)."""
    import numpy as np
    span = (x[-1] - x[0]) * 1e3 + 1.0
    lo = y[0] - (y[1] - y[0]) / (x[1] - x[0]) * span
    hi = y[-1] + (y[-1] - y[-2]) / (x[-1] - x[-2]) * span
    return (np.concatenate([[x[0] - span], x, [x[-1] + span]]),
            np.concatenate([[lo], y, [hi]]))


def figure(log: RunLog) -> Figure:
    """The 2x2 matplotlib Figure (Agg canvas) of ``log``."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(12, 8), layout="constrained")
    (loss_step, loss_tokens), (speed, memory) = fig.subplots(2, 2)
    fig.suptitle(f"tierflow run: {Path(log.path).name}")

    _loss_panel(loss_step, log, "step", "step")
    loss_step.set_title("loss vs step")
    steps, tokens = _series(log.train, "tokens")
    if len(steps) >= 2 and all(b > a for a, b in zip(tokens, tokens[1:])):
        s, t = _extend(np.array(steps, dtype=float), np.array(tokens, dtype=float))
        top = loss_step.secondary_xaxis(
            "top", functions=(lambda v: np.interp(v, s, t), lambda v: np.interp(v, t, s)))
        top.set_xlabel("tokens")
        top.xaxis.set_major_formatter(EngFormatter(sep=""))

    _loss_panel(loss_tokens, log, "tokens", "tokens trained on")
    loss_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))
    loss_tokens.set_title("loss vs tokens")

    xs, ys = _series(log.train, "tok_s")
    if xs:
        speed.plot(xs, ys, color="tab:green", linewidth=1, label="tokens/s")
        speed.axhline(float(np.median(ys)), color="tab:green", linestyle=":", linewidth=1,
                      label=f"median {np.median(ys):,.0f} tokens/s")
        speed.legend()
        speed.set_ylim(bottom=0)
    else:
        _empty(speed, "no tok_s in the log")
    _label(speed, "throughput", "step", "throughput (tokens/s)")

    tiers = sorted({t for r in log.train for t in r["mem"]})
    predicted = log.predicted_peak if "ram" in tiers else None
    peak = max([v for r in log.train for v in r["mem"].values()]
               + [float(log.budgets[t]) for t in tiers if t in log.budgets]
               + [float(predicted or 0)])
    unit, scale = _byte_unit(peak)
    colors = ["tab:purple", "tab:red", "tab:brown", "tab:cyan", "tab:olive", "tab:pink"]
    for i, tier in enumerate(tiers):
        color = colors[i % len(colors)]
        mx = [r["step"] for r in log.train if tier in r["mem"]]
        my = [r["mem"][tier] / scale for r in log.train if tier in r["mem"]]
        memory.plot(mx, my, color=color, linewidth=1, label=tier)
        if tier in log.budgets:
            memory.axhline(log.budgets[tier] / scale, color=color, linestyle="--", linewidth=1,
                           label=f"{tier} budget")
        if tier == "ram" and predicted:
            memory.axhline(predicted / scale, color=color, linestyle=":", linewidth=1,
                           label="ram predicted peak (plan)")
    if tiers:
        memory.legend()
        memory.set_ylim(bottom=0)
    else:
        _empty(memory, "no memory fields in the log")
    _label(memory, "memory per tier", "step", f"memory ({unit})")
    return fig


def plot_run(log: RunLog | str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Draw ``log`` (a RunLog or a path) into the image file ``out`` (format from its suffix:
    png, pdf, svg, ...). The file is written under a temporary name and renamed."""
    if not isinstance(log, RunLog):
        log = read_log(log)
    out = Path(out)
    fig = figure(log)
    formats = fig.canvas.get_supported_filetypes()
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in formats:
        raise TierflowError(f"-o {out}: cannot write a {fmt or 'suffix-less'} file; fix: end the "
                            f"name with one of {', '.join('.' + f for f in sorted(formats))}")
    if not out.parent.is_dir():
        raise TierflowError(f"-o {out}: the directory {out.parent} does not exist; fix: create "
                            "it or write elsewhere")
    try:
        with replacing(out) as tmp:
            fig.savefig(tmp, format=fmt, dpi=100)
    except OSError as err:
        raise TierflowError(f"-o {out} cannot be written ({err.strerror}): check the directory's "
                            "permissions and free space") from None
    return out


def register(sub: Any) -> None:
    """Add ``tierflow plot`` to the subcommands ``sub``."""
    plot = sub.add_parser(
        "plot", help="draw a training log: loss, tokens/s, memory per tier",
        description="Read the JSONL log of tierflow train (--log) and draw train and eval loss "
                    "against steps and tokens, tokens/s, and memory per tier into one image.")
    plot.add_argument("log", type=Path, metavar="LOG.jsonl", help="the training log")
    plot.add_argument("-o", "--out", type=Path, default=None, metavar="FILE",
                      help="image to write: .png, .pdf, .svg, ... (default LOG with .png)")
    plot.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Read the log, write the figure, print a one-line summary."""
    log = read_log(args.log)
    out = args.out if args.out is not None else args.log.with_suffix(".png")
    plot_run(log, out)
    print(log.summary(out), flush=True)
    return 0
