#!/usr/bin/env python3
"""W1: tierflow against plain PyTorch, HF gradient checkpointing and torch.compile, on the CPU.

    ./run bench                 # W1: Llama 12 x 768 (llama-134m), seq 1024, batch 4, bf16 autocast
    ./run bench --quick         # smoke test: llama-20m, seq 256, 2 steps
    ./run python benchmarks/remat.py --help

Every configuration runs in a fresh process (peak RSS is a per-process high-water mark):
the peers of ../shared/peers/peers.py (``train --mode plain``, ``hf-ckpt`` and ``compile`` with
activation_memory_budget 1.0/0.5/0.1) with this project's Python, then tierflow at RAM budgets
of 25/50/75/100% of the plain peer's peak above baseline, measured earlier in the same run,
with its decoder layers compiled once by torch.compile (``--eager`` to run them eagerly) and
a temporary directory as its disk tier (used only where the optimizer states do not fit).
Writes benchmarks/results/remat-<date>.md (tables), .json (every raw result) and .png
(median step time against peak memory, the budgets as vertical lines).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
try:
    from tierflow.cli import measure
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(ROOT / "src"))
    from tierflow.cli import measure
from tierflow.profile.machine import fast_bf16

GIB = 2**30
W1 = measure.Workload(arch="llama-134m", seq=1024, batch=4, steps=3, dtype="bf16", lr=1e-4)
QUICK = measure.Workload(arch="llama-20m", seq=256, batch=4, steps=2, dtype="bf16", lr=1e-4)
PEERS = ["plain", "hf-ckpt", "compile-1.0", "compile-0.5", "compile-0.1"]


def log(message: str) -> None:
    print(f"[remat {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- runs

def run_peer(peers: Path, name: str, w: measure.Workload, timeout: float) -> dict[str, Any]:
    mode, _, budget = name.partition("-") if name.startswith("compile") else (name, "", "")
    cmd = [sys.executable, str(peers), "train", "--mode", mode, "--arch", w.arch, "--seq", str(w.seq),
           "--batch", str(w.batch), "--steps", str(w.steps), "--dtype", w.dtype]
    if budget:
        cmd += ["--budget", budget]
    record: dict[str, Any] = {"config": name, "kind": "peer", "command": cmd[1:]}
    start = time.perf_counter()
    try:
        raw = measure.run_json(cmd, timeout=timeout)
    except measure.ChildError as err:
        record.update(status="failed", error=str(err))
        return record
    record.update(status="ok", raw=raw, wall_s=round(time.perf_counter() - start, 1),
                  step_s_median=raw["step_s_median"], tok_s=raw["tok_s"], losses=raw["losses"],
                  peak_above_baseline_bytes=int(round((raw["peak_rss_gib"] - raw["baseline_rss_gib"]) * GIB)))
    return record


def run_tierflow(w: measure.Workload, fraction: float, budget: int, timeout: float,
                 compile: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"config": f"tierflow-{fraction:.0%}", "kind": "tierflow",
                              "fraction": fraction, "budget_bytes": budget, "compiled": compile}
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="tierflow-disk-") as disk:
            raw = measure.measure(w, "tierflow", ram=budget, timeout=timeout, compile=compile,
                                  disk=disk)
    except (measure.ChildError, measure.ChildUserError) as err:
        record.update(status="failed", error=str(err))
        return record
    record.update(raw=raw, status=raw["status"], wall_s=round(time.perf_counter() - start, 1))
    if raw["status"] == "infeasible":
        record.update(smallest_bytes=raw.get("smallest"), error=raw["error"])
        return record
    record.update(step_s_median=raw["step_s_median"], tok_s=raw["tok_s"], losses=raw["losses"],
                  peak_above_baseline_bytes=raw["peak_above_baseline_bytes"],
                  predicted_peak_bytes=raw["predicted_peak_bytes"],
                  predicted_step_s=raw["predicted_step_s"], strategy=raw["strategy"],
                  fit_s=raw["fit_s"])
    return record


def describe_machine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Architecture"):
                info[key.strip().lower().replace(" ", "_")] = value.strip()
        info["bf16_native"] = fast_bf16()
    except OSError:
        pass
    try:
        mem = Path("/proc/meminfo").read_text().split()
        info["memory_gib"] = round(int(mem[mem.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    for r in runs:
        raw = r.get("raw") or {}
        if "torch" in raw:
            info.update(torch=raw["torch"], transformers=raw["transformers"], threads=raw["threads"])
            break
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        info["commit"] = commit + ("+uncommitted changes" if dirty else "")
    except OSError:
        pass
    return info


# ---------------------------------------------------------------- report

def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def fits(peak: int, budget: int) -> str:
    over = peak / budget - 1
    if over <= 0:
        return "yes"
    return f"yes ({over:+.1%}, within 5%)" if over <= 0.05 else f"**no** ({over:+.1%})"


def markdown(result: dict[str, Any]) -> str:
    w, m, runs = result["workload"], result["machine"], result["runs"]
    plain = next(r for r in runs if r["config"] == "plain")
    lines = [f"# W1 rematerialization benchmark ({result['date']}{', quick' if result['quick'] else ''})", "",
             f"Workload: {result['workload_text']}; {w['steps']} timed steps after one warm-up step, "
             f"each configuration in a fresh process.", "",
             f"Machine: {m.get('model_name', '?')}, {m.get('cpus')} CPUs, {m.get('memory_gib', '?')} GiB RAM, "
             f"torch {m.get('torch', '?')} ({m.get('threads', '?')} threads), transformers "
             f"{m.get('transformers', '?')}, Python {m['python']}; commit {m.get('commit', '?')}. "
             f"Load average (1 min) {result['load_average']['before'][0]} before the run, "
             f"{result['load_average']['after'][0]} after: other processes slow every timing.", "",
             "Peak = peak RSS above the RSS right after imports (`ru_maxrss`). tierflow's budgets are "
             "25/50/75/100% of the plain peer's peak measured in this run. `vs plain` = median step "
             "time / plain's. Predictions are tierflow's plan (`plan.predicted_peak`, "
             "`plan.predicted_time`), error relative to the measurement.", "",
             "| config | budget (GiB) | peak (GiB) | fits budget | median step (s) | tok/s | vs plain "
             "| loss, first step | predicted peak (GiB, error) | predicted step (s, error) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        name = r["config"] if r["kind"] == "tierflow" else f"{r['config']} (peer)"
        budget = _gib(r.get("budget_bytes")) if r["kind"] == "tierflow" else "—"
        if r["status"] != "ok":
            what = (f"infeasible (smallest {_gib(r.get('smallest_bytes'))} GiB)"
                    if r["status"] == "infeasible" else "failed (see the JSON)")
            lines.append(f"| {name} | {budget} | {what} | | | | | | | |")
            continue
        fit = fits(r["peak_above_baseline_bytes"], r["budget_bytes"]) if r["kind"] == "tierflow" else "—"
        ratio = (f"{r['step_s_median'] / plain['step_s_median']:.2f}x" if plain["status"] == "ok" else "—")
        pred_peak = pred_step = "—"
        if r["kind"] == "tierflow":
            pred_peak = (f"{_gib(r['predicted_peak_bytes'])} "
                         f"({_err(r['predicted_peak_bytes'], r['peak_above_baseline_bytes'])})")
            pred_step = f"{r['predicted_step_s']:.2f} ({_err(r['predicted_step_s'], r['step_s_median'])})"
        lines.append(f"| {name} | {budget} | {_gib(r['peak_above_baseline_bytes'])} | {fit} "
                     f"| {r['step_s_median']:.2f} | {r['tok_s']:,.0f} | {ratio} | {r['losses'][0]:.4f} "
                     f"| {pred_peak} | {pred_step} |")
    lines += ["", "Per budget: tierflow against the fastest peer whose measured peak fits the same budget.", "",
              "| budget (GiB) | tierflow step (s) | fastest peer that fits | its step (s) | tierflow at least as fast |",
              "|---|---|---|---|---|"]
    peers = [r for r in runs if r["kind"] == "peer" and r["status"] == "ok"]
    for r in runs:
        if r["kind"] != "tierflow":
            continue
        budget = r["budget_bytes"]
        fitting = [p for p in peers if p["peak_above_baseline_bytes"] <= budget]
        best = min(fitting, key=lambda p: p["step_s_median"]) if fitting else None
        mine = f"{r['step_s_median']:.2f}" if r["status"] == "ok" else r["status"]
        verdict = "—"
        if r["status"] == "ok":
            verdict = "yes (no peer fits)" if best is None else (
                "yes" if r["step_s_median"] <= best["step_s_median"] else "**no**")
        peer = f"{best['config']} | {best['step_s_median']:.2f}" if best else "none | —"
        lines.append(f"| {_gib(budget)} ({r['fraction']:.0%}) | {mine} | {peer} | {verdict} |")
    lines += ["", "Losses of every step (the same model, seed and tokens in every configuration):", ""]
    for r in runs:
        if r["status"] == "ok":
            lines.append(f"- {r['config']}: {' '.join(f'{x:.4f}' for x in r['losses'])}")
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""] + [f"- {r['config']}: {r['error'].splitlines()[0]}" for r in failed]
    lines += ["", f"Raw results: `{result['stem']}.json`; plot: `{result['stem']}.png`; rerun: "
              f"`./run bench{' --quick' if result['quick'] else ''}`.", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tf = [r for r in runs if r["kind"] == "tierflow"]
    for i, r in enumerate(tf):
        color = colors[(i + 1) % len(colors)]
        ax.axvline(r["budget_bytes"] / GIB, color=color, linestyle="--", linewidth=1,
                   label=f"budget {r['fraction']:.0%} ({r['budget_bytes'] / GIB:.2f} GiB)"
                         + ("" if r["status"] == "ok" else f", {r['status']}"))
    ok = [r for r in tf if r["status"] == "ok"]
    if ok:
        ax.plot([r["peak_above_baseline_bytes"] / GIB for r in ok], [r["step_s_median"] for r in ok],
                "o-", color=colors[0], label="tierflow", zorder=3)
        for r in ok:
            ax.annotate(f"{r['fraction']:.0%}", (r["peak_above_baseline_bytes"] / GIB, r["step_s_median"]),
                        textcoords="offset points", xytext=(5, 5), fontsize=8, color=colors[0])
    for r in runs:
        if r["kind"] == "peer" and r["status"] == "ok":
            x, y = r["peak_above_baseline_bytes"] / GIB, r["step_s_median"]
            ax.plot(x, y, "s", color="0.3", zorder=3)
            ax.annotate(r["config"], (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("peak RSS above post-import baseline (GiB)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"W1 {'(quick) ' if result['quick'] else ''}{result['workload']['arch']}, "
                 f"seq {result['workload']['seq']} x batch {result['workload']['batch']}, {result['date']}",
                 fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="llama-20m, seq 256, 2 steps: a smoke test")
    p.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 3)")
    p.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers" / "peers.py",
                   help="path of peers.py (default: ../shared/peers/peers.py from the repo root)")
    p.add_argument("--skip-peers", default="", metavar="NAMES",
                   help=f"comma-separated peers not to run, of {','.join(PEERS[1:])} (plain always runs)")
    p.add_argument("--budgets", default="0.25,0.5,0.75,1.0",
                   help="tierflow budgets as fractions of plain's peak (default 0.25,0.5,0.75,1.0)")
    p.add_argument("--eager", action="store_true",
                   help="run tierflow's stages eagerly (default: decoder layers torch.compiled once)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    args = p.parse_args(argv)
    if not args.peers.is_file():
        p.error(f"--peers {args.peers}: no such file; give the path of peers.py")
    skip = {s for s in args.skip_peers.split(",") if s}
    if skip - set(PEERS[1:]):
        p.error(f"--skip-peers: unknown {sorted(skip - set(PEERS[1:]))}; choose from {PEERS[1:]}")
    fractions = [float(f) for f in args.budgets.split(",") if f]
    base = QUICK if args.quick else W1
    w = measure.Workload(base.arch, base.seq, base.batch, args.steps or base.steps, base.dtype, base.lr)
    date = dt.date.today().isoformat()
    stem = f"remat-{'quick-' if args.quick else ''}{date}"
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"W1{' (quick)' if args.quick else ''}: {w.describe()}; results to {args.out}/{stem}.*")

    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    for name in [n for n in PEERS if n not in skip]:
        log(f"peer {name} ...")
        runs.append(run_peer(args.peers, name, w, args.timeout))
        _log_run(runs[-1])
    plain = runs[0]
    if plain["status"] != "ok":
        log("the plain peer failed: no budgets to measure tierflow at")
        print(plain["error"], file=sys.stderr)
        return 1
    for fraction in fractions:
        budget = int(fraction * plain["peak_above_baseline_bytes"])
        log(f"tierflow at {fraction:.0%} of plain's peak = {budget / GIB:.2f} GiB ...")
        runs.append(run_tierflow(w, fraction, budget, args.timeout, not args.eager))
        _log_run(runs[-1])

    result = {"date": date, "quick": args.quick, "stem": stem, "workload": asdict(w) | {"tokens_per_step": w.tokens_per_step},
              "workload_text": w.describe(), "machine": describe_machine(runs), "runs": runs,
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    plot(result, args.out / f"{stem}.png")
    print(text)
    log(f"wrote {args.out}/{stem}.md, .json and .png")
    return 0


def _log_run(r: dict[str, Any]) -> None:
    if r["status"] == "ok":
        log(f"  {r['config']}: peak {r['peak_above_baseline_bytes'] / GIB:.2f} GiB, "
            f"median step {r['step_s_median']:.2f} s, {r['tok_s']:,.0f} tok/s, losses {r['losses']}")
    else:
        log(f"  {r['config']}: {r['status']}: {r.get('error', '').splitlines()[0] if r.get('error') else ''}")


if __name__ == "__main__":
    sys.exit(main())
