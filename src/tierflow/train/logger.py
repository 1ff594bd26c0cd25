"""What ``tierflow train`` prints and logs: sections, one ``[T]`` line per step, ``[V]`` lines,
a progress bar on a terminal (only), and every record as one JSON line in the log file."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TextIO

from ..core.errors import TierflowError
from ..core.units import format_bytes, format_margin, format_rate, section
from ..plan.tier_costs import UpdatePass, with_update_pass

GIB = 2 ** 30


@dataclass(frozen=True)
class StepLine:
    """The figures of one step's ``[T]`` line: its time, gradient norm, loss, tokens/s, SOL
    (None: not measured), the peak RSS above the baseline against ``budget`` and, when a
    CUDA GPU trains, its allocator's peak against ``gpu_budget``."""
    step: int
    total: int
    ms: float
    norm: float
    loss: float
    tok_s: float
    sol: float | None
    ram_bytes: int | None
    budget: int | None
    gpu_bytes: int | None = None
    gpu_budget: int | None = None

    def text(self) -> str:
        """``[T] step 12 [ 3.1%] | 1869 ms | norm 4.31 | loss 3.282 | 35.1k tok/s | sol 42.9% |
        ram 3.1/4.0 GiB``, and ``| gpu 7.2/8.0 GiB`` when a CUDA GPU trains."""
        pct = 100.0 * self.step / self.total if self.total else 100.0
        sol_text = f"{100 * self.sol:.1f}%" if self.sol is not None else "-"
        line = (f"[T] step {self.step} [{pct:4.1f}%] | {self.ms:.0f} ms | norm {self.norm:.2f} | "
                f"loss {self.loss:.3f} | {format_rate(self.tok_s)} tok/s | sol {sol_text} | "
                f"ram {_used(self.ram_bytes, self.budget)}")
        if self.gpu_bytes is None:
            return line
        return line + f" | gpu {_used(self.gpu_bytes, self.gpu_budget)}"


# a measured peak this close to --ram (a fraction of it) is worth a warning: the plan's
# prediction has missed by a few MiB between runs (docs/benchmarks.md), which would then pass
NEAR_BUDGET = 0.02


def near_budget(ram_bytes: int | None, budget: int | None) -> str | None:
    """A warning when the peak RSS above the baseline, ``ram_bytes``, comes within
    ``NEAR_BUDGET`` of the RAM ``budget`` (None otherwise); the step loop says it once."""
    if not budget or ram_bytes is None or ram_bytes < budget * (1 - NEAR_BUDGET):
        return None
    where = "passed" if ram_bytes > budget else f"is within {NEAR_BUDGET:.0%} of"
    return (f"[!] the peak RSS, {format_bytes(ram_bytes)} above the baseline, {where} "
            f"--ram {format_bytes(budget)} ({ram_bytes / budget:.1%}): the plan predicted "
            "less; a larger --ram, or --enforce to have the kernel hold it")


def _used(nbytes: int | None, budget: int | None) -> str:
    used = "-" if nbytes is None else f"{nbytes / GIB:.1f}"
    return used + (f"/{budget / GIB:.1f} GiB" if budget else "/- GiB")


def eval_line(*, step: int, loss: float, ppl: float, ms: float) -> str:
    return f"[V] step {step} | eval loss {loss:.3f} | ppl {ppl:.2f} | {ms:.0f} ms"


@dataclass(frozen=True)
class PlanPrecision:
    """What the ``[Plan]`` table says about precision: ``per`` is the run's
    ``PrecisionConfig.bytes_per_parameter()``, ``trainable`` the trainable parameter count,
    ``master`` this rank's bytes of fp32 master copy (part of the reserved optimizer states),
    ``dtypes`` the ``PrecisionConfig`` as a dict, ``frozen`` the frozen parameter count
    (``--freeze``, ``--train-only``) and ``tied_frozen`` the names of each frozen parameter
    that has several."""
    per: Any
    trainable: int
    master: int
    dtypes: dict[str, str]
    frozen: int = 0
    tied_frozen: tuple[tuple[str, ...], ...] = ()


def _per(value: float) -> str:
    return f"{value:g} B/parameter"


def plan_section(plan: Any, *, grads: int, budget: int | None, grad_accum: int,
                 dist: dict[str, Any] | None, precision: PlanPrecision,
                 update_pass: UpdatePass | None = None,
                 step_temporaries: int = 0) -> tuple[str, dict[str, Any]]:
    """The ``[Plan]`` table (bytes per kind and per parameter, the strategy, the predicted
    step) and the fields of its JSON record. The optimizer states (master and moments) and
    ``step_temporaries`` (what a step of the optimizer after the backward allocates besides)
    are what the plan reserves for the optimizer. ``update_pass`` is the pass after the backward
    when updates are deferred: its time is part of the step and its peak may be the step's.
    Under torchrun ``dist`` holds ``world_size``, ``backend``, ``bus_bandwidth`` (bytes/s),
    ``comm_bytes``, ``predicted_comm_s`` and ``replicas`` (True: every rank holds every
    state, ``roles.ranks_hold_replicas``; False: ZeRO-2 shards); every figure is this
    rank's (budgets are per rank)."""
    extra = plan.costs.extra
    peak = with_update_pass(plan.predicted_peak, update_pass)
    per, dtypes = precision.per, precision.dtypes
    activations = max(0, plan.simulation.peak - grads)
    reserved = (extra.get("reserved", 0) - step_temporaries  # the states, or fit's own
                or extra.get("optimizer states", 0))
    master = min(precision.master, reserved)
    kinds = [("weights", extra.get("parameters", 0)), ("gradients", grads),
             ("master", master), ("moments", reserved - master),
             ("optimizer step", step_temporaries),
             ("activations", activations), ("runtime", extra.get("runtime", 0)),
             ("allocator", extra.get("allocator", 0))]
    shard = f", 1/{dist['world_size']} shard" if dist is not None and not dist["replicas"] \
        else ""
    weight = dtypes["model_dtype"]
    if per.master:
        master_note = f"{_per(per.master)}, fp32 copy of the bf16 weights"
    else:
        master_note = ("none: stochastic rounding" if weight == "bf16"
                       else "none: fp32 weights are their own")
    scales = f" + {per.moment_scales:g} of scales" if per.moment_scales else ""
    notes = {"weights": f"{_per(per.weights)}, {weight}",
             "gradients": f"{_per(per.gradients)}, {weight}",
             "master": master_note,
             "moments": f"{_per(per.moments)}{scales}, AdamW m and v in {dtypes['optim_dtype']}",
             "optimizer step": "float32 temporaries of AdamW's step after the backward",
             "allocator": "what malloc holds beside the live bytes"}
    total = per.weights + per.gradients + per.master + per.moments
    rows: list[tuple[str, Any]] = [
        ("parameters", f"{precision.trainable:,} trainable x {total:g} bytes (weights "
                       f"{per.weights:g} + gradients {per.gradients:g} + master {per.master:g} + "
                       f"moments {per.moments:g})")]
    if precision.frozen:
        tied = "".join(f"; {' and '.join(names)} are one tied parameter, frozen under each "
                       "name" for names in precision.tied_frozen)
        rows.append(("frozen", f"{precision.frozen:,} parameters x {per.weights:g} bytes "
                               f"(weights only: no gradient, no optimizer state){tied}"))
    for name, value in kinds:
        if name in ("optimizer step", "allocator") and not value:
            continue
        if name == "master":
            below = extra.get("optimizer states on disk", 0)
            rows.append((f"optimizer states (reserved{shard})",
                         f"{format_bytes(reserved)} (master + moments)" + (
                             f"; {format_bytes(below)} on the disk tier" if below else "")))
        label = f"  {name}" if name in ("master", "moments") else name
        note = f" ({notes[name]})" if name in notes else ""
        rows.append((label, format_bytes(value) + note))
    if update_pass is not None:
        rows.append(("update pass", f"{format_bytes(update_pass.peak)} at its peak (after the "
                                    "backward: clipping or gradient accumulation)"))
    rows.append(("total (predicted peak)", format_bytes(peak)))
    stashed = plan.stashed_boundaries()
    below: dict[str, dict[str, int]] = {}  # lower tier -> what it holds -> bytes
    for tier in ("ram", "disk"):  # the tiers below the compute tier (ram: under a GPU)
        held = [(extra.get(f"optimizer states on {tier}", 0), "optimizer states"),
                (extra.get("streamed bytes", 0) if extra.get("weights tier") == tier else 0,
                 f"weights of {len(extra.get('streamed stages', []))} streamed stages"),
                (extra.get("offloaded tape bytes", 0) if extra.get("tapes tier") == tier
                 else 0, f"tapes of {len(extra.get('offloaded tapes', []))} stages"),
                (sum(plan.costs.x_bytes(i) for i in stashed)
                 if extra.get("boundaries tier") == tier else 0,
                 f"{len(stashed)} checkpoint{'s' if len(stashed) != 1 else ''}"),
                (extra.get("host step bytes", 0) if tier == "ram" else 0,
                 f"for AdamW's steps there ({_host_step_buffers(extra)})")]
        below[tier] = {what: int(n) for n, what in held if n}
        if below[tier]:
            depth = extra.get("prefetch depth", 0)
            ahead = f"read {depth} stages ahead" if depth else "read when needed (no prefetch)"
            rows.append((f"{tier} tier", " + ".join(f"{format_bytes(n)} {what}"
                                                    for what, n in below[tier].items())
                         + f"; {ahead}"))
    # the plan was made for the budget less what the process held before planning (under
    # --ram: torch's first-use caches, the model's objects): that is not free either
    held = budget - plan.budget if budget and plan.budget is not None else 0
    free = (format_margin(peak + held, budget) + " between the predicted peak and the budget"
            + (f" ({format_bytes(held)} is held outside the plan)" if held else "")
            if budget else "- (no --ram budget)")
    seconds = plan.step_time(grad_accum)
    if update_pass is not None:
        seconds += update_pass.seconds
        updates = f"+ {update_pass.seconds * 1e3:.0f} ms update pass"
    elif plan.costs.optimizer_owned:
        updates = "updates inside the backward included"
    else:
        updates = "optimizer not included"
    first, rest = plan.step_time(1), plan.predicted_time  # the first reads no gradients
    passes = (f"{grad_accum} x {rest * 1e3:.0f} ms forward+backward" if first == rest else
              f"{first * 1e3:.0f} ms, then {grad_accum - 1} x {rest * 1e3:.0f} ms "
              "forward+backward")
    step = f"{seconds * 1e3:.0f} ms ({passes}, {updates})"
    rows += [("margin", free), ("strategy", plan.strategy), ("predicted step", step)]
    fields: dict[str, Any] = {k: int(v) for k, v in kinds if k != "optimizer step"}
    fields["optimizer states (reserved)"] = int(reserved)  # master + moments
    fields["optimizer step (reserved)"] = int(step_temporaries)
    fields.update(bytes_per_parameter={"weights": per.weights, "gradients": per.gradients,
                                       "master": per.master, "moments": per.moments,
                                       "moment_scales": per.moment_scales, "total": per.total},
                  trainable_parameters=precision.trainable, precision=dict(dtypes),
                  predicted_peak=int(peak), budget=budget, held_outside_the_plan=int(held),
                  strategy=plan.strategy, predicted_step_s=seconds,
                  disk_bytes=below["disk"], ram_tier_bytes=below["ram"],
                  prefetch_depth=extra.get("prefetch depth"), decisions=plan.decisions())
    if dist is not None:
        n = dist["world_size"]
        parallel = (f"{n} ranks ({dist['backend']}); ZeRO-2: AdamW moments and reduced "
                    f"gradients sharded 1/{n}, parameters all-gathered after each update")
        if dist["replicas"]:
            parallel = (f"{n} ranks ({dist['backend']}); replicas: each rank holds the whole "
                        "model and its optimizer states on a disk tier of its own, and "
                        "averages each stage's gradients over the ranks (all-reduce) before "
                        "its update")
        comm = (f"{dist['predicted_comm_s'] * 1e3:.2f} ms per step predicted "
                f"({format_bytes(dist['comm_bytes'])} through each rank's link at "
                f"{format_bytes(dist['bus_bandwidth'])}/s bus bandwidth, measured at start; "
                "the gradient reductions are the plan's reduce ops, in its predicted step)")
        rows += [("data parallel", parallel), ("communication", comm)]
        fields.update({k: v for k, v in dist.items() if k != "comm_bytes"})
    return section("Plan", rows), fields


def _host_step_buffers(extra: dict[str, Any]) -> str:
    """What the host RAM holds for AdamW steps run there, for the [Plan]'s ram-tier line."""
    held = ["gradients", "temporaries"]
    if extra.get("optimizer states on disk"):
        held.append("states read from disk")
    if extra.get("host steps read weights"):
        held.append("weights read from disk")
    return ", ".join(held)


class Logger:
    """Prints to ``out`` (stdout) and appends JSON records to ``log_path`` (flushed per line).
    The progress bar goes to stderr and only when stderr is a terminal. An inactive logger
    (ranks other than 0 under torchrun) prints and writes nothing."""

    def __init__(self, log_path: Path | None, *, out: TextIO | None = None, append: bool = False,
                 active: bool = True):
        self.out = out or sys.stdout
        self.bar_stream = sys.stderr
        self.tty = self.bar_stream.isatty()
        self._bar_shown = False
        self.path = log_path
        self.active = active
        self.file = None
        if log_path is None:  # printed only (tierflow eval's plan): no JSON log
            self._pending = None
            return
        # a new run writes beside the log already there until it is under way (``keep``): a
        # run refused before that (a budget no plan fits, bad input) leaves that log intact
        pending = log_path.with_name(log_path.name + ".new")
        self._pending = None if append else pending
        if not active:
            return
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            if append:  # left by a new run killed before its plan: the log of no run
                pending.unlink(missing_ok=True)
            self.file = open(self._pending or log_path, "a" if append else "w",
                             encoding="utf-8")
        except OSError as e:
            raise TierflowError(f"cannot write the log {log_path} ({e.strerror}): use --log or "
                                "--out with a writable path") from None

    def record(self, kind: str, **fields: Any) -> None:
        if self.file is None:
            return
        fields = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.file.write(json.dumps(fields, default=str) + "\n")
        self.file.flush()

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """Within: nothing printed, records still written (a header printed once already)."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

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

    def keep(self) -> None:
        """The run is under way (it has its plan): its log replaces the one at ``path``."""
        if self._pending is not None and self.file is not None:
            os.replace(self._pending, self.path)  # the open file follows the rename
        self._pending = None

    def close(self) -> None:
        """Close the log; one never kept (the run ended before it was under way) is removed."""
        self._clear_bar()
        if self.file is not None:
            self.file.close()
            if self._pending is not None:
                self._pending.unlink(missing_ok=True)
