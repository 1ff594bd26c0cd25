"""Measure one training configuration in a fresh child process (``tierflow compare``; the
benchmark scripts run their children with the same ``run_json``).

    python -m tierflow.cli.measure --mode plain|tierflow --arch llama-20m --seq 512 --batch 4 \\
        --steps 3 --dtype bf16 [--ram 600MiB] [--planner auto]

prints one JSON line: the median step time over ``--steps`` timed steps after one warm-up
step, tokens/s, the loss of every step, and the process's peak RSS above its RSS right after
imports (``profile/machine.maxrss_bytes``; transformers' model code imported too, as the
trainer and the peers take their baselines). ``fit`` is given that baseline: the budget covers
everything above it, the model's objects included. ``--arch`` is one of the Llama presets of
``models/presets.py``, built as ``peers.py`` builds its Llamas (the same config,
``torch.manual_seed(0)``, tokens drawn right after), so its losses can be compared with the
peers' and with each other.

The parent side (:func:`measure`, :func:`run_json`) imports no torch. Children are started
through ``/bin/sh``, which forks them: on Linux a process's ``ru_maxrss`` starts at its parent's
high-water mark when the parent execs it directly, which would hide the child's own peak.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..models.presets import PRESETS, preset_config
from ..profile.machine import maxrss_bytes

# the presets compare builds and counts: the Llamas (one architecture, as peers.py's)
ARCHS = tuple(name for name, preset in PRESETS.items() if preset.family == "llama")


class ChildError(RuntimeError):
    """A child process crashed or printed no result (a bug, not a user error)."""


class ChildUserError(ValueError):
    """The child stopped on a tierflow user error (bad budget, ...); its one-line message."""


@dataclass(frozen=True)
class Workload:
    arch: str = "llama-20m"
    seq: int = 512
    batch: int = 4
    steps: int = 3  # timed steps, after one warm-up step
    dtype: str = "bf16"  # "bf16" (autocast on the CPU) or "fp32"
    lr: float = 1e-4

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.batch

    def params(self) -> int:
        """Parameter count of the Llama built for this workload (no biases; a tied head
        once), from its preset's shape: no torch on the parent side."""
        p = PRESETS[self.arch]
        head_dim = p.extra.get("head_dim", p.hidden // p.heads)
        block = (2 * p.hidden * p.heads * head_dim + 2 * p.hidden * p.kv_heads * head_dim
                 + 3 * p.hidden * p.mlp + 2 * p.hidden)
        return (1 if p.tied else 2) * p.vocab * p.hidden + p.layers * block + p.hidden

    def describe(self) -> str:
        """The workload in words: the model's shape and size, the batch, precision and
        optimizer."""
        p = PRESETS[self.arch]
        autocast = "bf16 autocast" if self.dtype == "bf16" else "fp32"
        return (f"{self.arch} ({p.layers} layers, hidden {p.hidden}, MLP {p.mlp}, {p.heads} "
                f"heads, vocab {p.vocab}; {self.params() / 1e6:.1f}M parameters), seq "
                f"{self.seq} x batch {self.batch}, {autocast}, AdamW lr {self.lr:g}")

    def args(self) -> list[str]:
        return ["--arch", self.arch, "--seq", str(self.seq), "--batch", str(self.batch),
                "--steps", str(self.steps), "--dtype", self.dtype, "--lr", repr(self.lr)]


# ---------------------------------------------------------------- parent side (no torch)

def last_json(text: str) -> Any:
    """The last line of ``text`` that parses as a JSON object or array starting with ``{``
    (a child's result line, after whatever it logged), or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_json(cmd: list[str], *, timeout: float | None = None, env: dict[str, str] | None = None,
             cwd: str | Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` in a fresh process (forked by /bin/sh) and return the last JSON line it prints.

    Raises ChildError with the tail of its stderr if it fails or prints no JSON object.
    """
    full = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *cmd] if os.path.exists("/bin/sh") else cmd
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise ChildError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s; "
                         f"stderr ends with:\n{_tail(err)}") from None
    except BaseException:  # Ctrl-C: take the child down with us
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    result = last_json(out)
    if proc.returncode != 0 or not isinstance(result, dict):
        raise ChildError(f"{' '.join(cmd)} exited with {proc.returncode} "
                         f"{'and no JSON result' if result is None else ''}; "
                         f"stderr ends with:\n{_tail(err)}\nstdout ends with:\n{_tail(out)}")
    return result


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def measure(workload: Workload, mode: str, *, ram: int | None = None, planner: str = "auto",
            compile: bool = False, disk: str | None = None, timeout: float | None = None,
            python: str | None = None) -> dict[str, Any]:
    """Measure ``workload`` in ``mode`` ("plain" or "tierflow") in a fresh child process.

    Returns the child's JSON record. A child stopped by a tierflow budget error returns a
    record with ``status == "infeasible"`` and ``smallest`` (bytes); other tierflow user
    errors raise ChildUserError, crashes raise ChildError.
    """
    cmd = [python or sys.executable, "-m", "tierflow.cli.measure", "--mode", mode, *workload.args()]
    if ram is not None:
        cmd += ["--ram", str(int(ram))]
    if mode == "tierflow":
        cmd += ["--planner", planner] + (["--compile"] if compile else [])
        cmd += ["--disk", disk] if disk else []
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the child imports this same tierflow
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    result = run_json(cmd, timeout=timeout, env=env)
    if result.get("status") == "error":
        raise ChildUserError(result["error"])
    return result


# ---------------------------------------------------------------- child side

def _status_bytes(field: str) -> int | None:
    """VmHWM / VmRSS of this process from /proc (Linux only), for cross-checks."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build(arch: str, seq: int):
    """The Llama preset ``arch`` as ``peers.py build()`` makes its Llamas: positions for at
    least ``seq`` tokens, initialized from ``torch.manual_seed(0)``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = preset_config(arch, max_positions=max(seq, PRESETS[arch].positions))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _smallest(err: BaseException) -> int | None:
    smallest = getattr(err, "smallest", None)
    if isinstance(smallest, int):
        return smallest
    from ..core.units import parse_bytes
    match = re.search(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B)\b", str(err))
    return parse_bytes(match.group(1) + match.group(2)) if match else None


def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierflow.cli.measure", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["plain", "tierflow"], default="plain")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama-20m")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ram", type=int, default=None, help="tierflow's RAM budget, bytes")
    p.add_argument("--planner", default="auto")
    p.add_argument("--compile", action="store_true", help="tierflow: torch.compile the decoder layers")
    p.add_argument("--disk", default=None, help="tierflow: a directory for the disk tier")
    args = p.parse_args(argv)

    import torch
    import transformers

    # transformers' model code (some 130 MiB, imported when the first model is built) is part
    # of the baseline, as in tierflow train and the peers: imports are not the workload
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import tierflow
    from tierflow.exec.memory import rss_bytes
    if args.mode == "tierflow":
        import tierflow.fitting.fit  # noqa: F401  (part of the baseline: imports are not the workload)
    base = maxrss_bytes()
    base_rss = rss_bytes()  # fit's budget counts from here: what the model's build holds too
    base_hwm = _status_bytes("VmHWM")

    model = build(args.arch, args.seq)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    bf16 = args.dtype == "bf16"
    record: dict[str, Any] = {
        "config": "plain" if args.mode == "plain" else "tierflow", "status": "ok",
        "workload": asdict(Workload(args.arch, args.seq, args.batch, args.steps, args.dtype, args.lr)),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "ram_budget_bytes": args.ram}

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    if args.mode == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

        def step() -> float:
            with autocast():
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    else:
        start = time.perf_counter()
        try:
            with autocast():
                config = tierflow.FitConfig(planner=args.planner, compile=args.compile)
                module = tierflow.fit(model, {"input_ids": tokens, "labels": tokens}, ram=args.ram,
                                      optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
                                      disk=args.disk, config=config, baseline=base_rss)
        except tierflow.BudgetError as err:
            record.update(status="infeasible", error=str(err), smallest=_smallest(err))
            print(json.dumps(record), flush=True)
            return 0
        except ValueError as err:  # other user errors; a plain ValueError from torch is a bug
            if not isinstance(err, tierflow.TierflowError) and "tierflow" not in type(err).__module__:
                raise
            record.update(status="error", error=str(err))
            print(json.dumps(record), flush=True)
            return 0
        plan = module.plan
        record.update(fit_s=round(time.perf_counter() - start, 3), strategy=plan.strategy,
                      compiled=args.compile, disk_bytes=plan.costs.extra.get("optimizer states on disk", 0),
                      predicted_peak_bytes=int(plan.predicted_peak),
                      predicted_step_s=float(plan.predicted_time), explain=plan.explain(),
                      peak_after_fit_bytes=maxrss_bytes() - base)

        def step() -> float:
            with autocast():
                loss = module(input_ids=tokens, labels=tokens).loss
            loss.backward()  # the optimizer updates each stage's parameters inside backward
            return loss.item()

    times, losses = [], []
    for _ in range(args.steps + 1):  # the first step is warm-up
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:]) if len(times) > 1 else times[0]
    peak = maxrss_bytes()
    hwm = _status_bytes("VmHWM")
    record.update(step_s_median=round(median, 4), step_s=[round(t, 4) for t in times],
                  tok_s=round(args.batch * args.seq / median, 1),
                  losses=[round(x, 4) for x in losses],
                  baseline_rss_bytes=base, peak_rss_bytes=peak, peak_above_baseline_bytes=peak - base,
                  vmhwm_above_baseline_bytes=(hwm - base_hwm) if hwm and base_hwm else None)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
