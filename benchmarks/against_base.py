#!/usr/bin/env python3
"""This tree against an earlier commit, in the same run: W1 and W2 trained by `tierflow
train` from each source tree, each configuration in a fresh process, the two trees
alternating, so that both see the same machine.

    ./run python benchmarks/against_base.py --base REF [--only w1,w2] [--steps 3] [--rounds 1]
        [--tag TAG] [--w1-shares 25,50,100] [--w2-budgets 2GiB,4GiB,8GiB]

REF's source is checked out into a temporary git worktree. Configurations:
- W1: llama-134m, seq 1024, batch 4, bf16 autocast, under `--ram` of 25, 50 and 100% of the
  plain PyTorch peer's peak above its baseline (`../shared/peers/peers.py train --mode plain`,
  measured first in the same run), with a disk tier for what does not fit;
- W2: tinyllama-1.1b, seq 1024, batch 2, bf16 autocast, `--ram` 2, 4 and 8 GiB over a disk
  tier (its model built onto it).
`--dtype fp32` runs both, and the peer, with fp32 matmuls instead: on a CPU without native
bf16 (AVX2 only) bf16 matmuls run a scalar fallback a hundred times slower.
Both on random tokens, AdamW lr 1e-4 without clipping or warm-up. `--rounds N` runs each
configuration N times per tree (base, head, base, head, ...): on a 2-core VM one process's
median step varies by up to 10% from the next one's, so a ratio from one process each cannot
tell 5% apart. Reported per tree: the median over its rounds of each process's median step
after the first, the median of their peak RAM above the post-import baseline (the trainer's
`ram` figure), each round's figures, the plan's predicted step and peak (of the first round;
the peak with what the process held outside the plan, which the measured figure counts too),
and the ratios of this tree to the base, and the seconds each took to profile and plan;
for this tree, how far the prediction is off, and for W2 whether the plan `tierflow plan
--hardware cpu ... --json` prints (fresh process, right after the run) made the same
decisions (`Plan.decisions`: strategy, recomputed and stashed stages, what streams where,
how far ahead) as the plan `tierflow train` ran, once on analytic costs and once with
`--measure` (the stages measured here as the trainer measures them).
Writes benchmarks/results/against-base-<date>[-TAG].{md,json} (the JSON names both commits
and the CPU) after every row, so a run cut short keeps the rows it finished. Run it on a quiet machine. `--replan RESULT` only reruns the W2 rows' `tierflow
plan` of a saved result with this tree.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import predicted_ram_peak
from random_tokens import random_token_files
from tierflow.profile.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers" / "peers.py"
RESULTS = ROOT / "benchmarks" / "results"
VOCAB = 32000
GIB = 2 ** 30


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                          text=True, check=True).stdout.strip()


def plain_peak(steps: int, dtype: str) -> float:
    """GiB the plain PyTorch peer holds above its baseline at W1."""
    cmd = [sys.executable, str(PEERS), "train", "--mode", "plain", "--arch", "llama-134m",
           "--seq", "1024", "--batch", "4", "--steps", str(steps), "--dtype", dtype]
    row = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    return row["peak_rss_gib"] - row["baseline_rss_gib"]


def train_records(tree: Path, model: str, batch: int, ram: str, steps: int, data: Path,
                  work: Path, dtype: str) -> dict[str, list[dict]] | dict[str, str]:
    """One `tierflow train` run of ``tree``'s source in a fresh process: its log's records
    by kind, or {"error": its last line}."""
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    log = work / "log.jsonl"
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", model, "--data", str(data),
           "--seq-len", "1024", "--batch-size", str(batch), "--steps", str(steps),
           "--dtype", dtype, "--lr", "1e-4", "--warmup", "0", "--clip", "0",
           "--weight-decay", "0.01", "--eval-every", "0", "--save-every", "0",
           "--ram", ram, "--disk", str(disk), "--out", str(work / "out"), "--log", str(log)]
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    # a W2 checkpoint and a W2 disk tier are 13 GB each: one run's at a time
    shutil.rmtree(work / "out", ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    records: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    return records


def train(tree: Path, model: str, batch: int, ram: str, steps: int, data: Path,
          work: Path, dtype: str) -> dict:
    """One `tierflow train` run of ``tree``'s source in a fresh process: its median step
    after the first, its peak, its plan's predictions and decisions, and the seconds from
    its dataset's log record to its plan's (the profile and the planning)."""
    records = train_records(tree, model, batch, ram, steps, data, work, dtype)
    if "error" in records:
        return records
    steps_s = [r["ms"] / 1e3 for r in records["train"]]
    plan = records["plan"][0]
    row = {"step_s": round(statistics.median(steps_s[1:]), 3),
           "steps_s": [round(s, 3) for s in steps_s],
           "peak_gib": round(max(r["ram_bytes"] for r in records["train"]) / GIB, 3),
           "predicted_step_s": round(plan["predicted_step_s"], 3),
           "predicted_peak_gib": round(predicted_ram_peak(plan) / GIB, 3),
           "held_outside_the_plan_gib": round(plan.get("held_outside_the_plan", 0) / GIB, 3),
           "planning_s": round(plan["time"] - records["dataset"][0]["time"], 1)}
    if "decisions" in plan:  # trees that log them
        row["decisions"] = plan["decisions"]
    return row


def over_rounds(rounds: list[dict]) -> dict:
    """One tree's row from its rounds: the first round's plan, the medians of the rounds'
    step and peak, and each round's (an error if any round failed)."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    if len(rounds) == 1:
        return rounds[0]
    return {**rounds[0], "step_s": round(statistics.median(r["step_s"] for r in rounds), 3),
            "peak_gib": round(statistics.median(r["peak_gib"] for r in rounds), 3),
            "rounds": [{"step_s": r["step_s"], "steps_s": r["steps_s"],
                        "peak_gib": r["peak_gib"]} for r in rounds]}


# a row's key for each `tierflow plan` run: its extra flags, and the key of whether it made
# the trainer's decisions
PLAN_COMMANDS = {"plan_command": ([], "same_plan"),
                 "plan_measured": (["--measure"], "same_plan_measured")}


def predicted_decisions(tree: Path, model: str, batch: int, ram: str, disk: Path,
                        flags: list[str], dtype: str) -> dict:
    """What `tierflow plan --hardware cpu --json` of ``tree``, with ``flags``, decides for
    the same run."""
    disk.mkdir(parents=True, exist_ok=True)  # the run's own was removed after it
    cmd = [sys.executable, "-m", "tierflow", "plan", "--model", model, "--hardware", "cpu",
           "--ram", ram, "--disk", str(disk), "--seq-len", "1024", "--batch-size", str(batch),
           "--matmul-dtype", dtype, "--clip", "0", "--json", *flags]  # as `train`: no clip
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    prediction = json.loads(proc.stdout)
    return {"decisions": prediction["placement"]["decisions"],
            "busy_s": {resource: round(seconds, 3) for resource, seconds
                       in prediction["placement"]["times"].items()},
            "predicted_step_s": round(prediction["step_time"], 3),
            "predicted_peak_gib": round(prediction["placement"]["peaks"]["ram"] / GIB, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git ref to compare with")
    parser.add_argument("--only", default="w1,w2")
    parser.add_argument("--w1-shares", default="25,50,100",
                        help="W1's --ram values in %% of plain PyTorch's peak, comma-separated")
    parser.add_argument("--w2-budgets", default="2GiB,4GiB,8GiB",
                        help="W2's --ram values, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="the matmuls' dtype of both workloads, in the peer too (fp32 on a "
                             "CPU without native bf16, where bf16 runs a scalar fallback)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh processes per configuration and tree, the trees alternating")
    parser.add_argument("--tag", default="")
    parser.add_argument("--replan", type=Path, default=None, metavar="RESULT",
                        help="only rerun `tierflow plan` for the W2 rows of RESULT (a JSON this "
                             "script wrote) with this tree, and rewrite RESULT and its table")
    args = parser.parse_args()
    if args.replan is not None:
        replan(args.replan)
        return
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            data = random_token_files(tmp / "data", VOCAB)
            trees = {"base": base, "head": ROOT}
            configs = []
            if "w1" in args.only:
                peak = plain_peak(args.steps, args.dtype)
                configs += [("W1", "llama-134m", 4, f"{share}%", f"{peak * share / 100:.3f}GiB")
                            for share in map(int, args.w1_shares.split(","))]
            if "w2" in args.only:
                configs += [("W2", "tinyllama-1.1b", 2, ram, ram)
                            for ram in args.w2_budgets.split(",")]
            rows: list[dict] = []
            result = {"date": stamp, "cpu": cpu_model(), "cores": os.cpu_count(),
                      "base": commit_of(base), "head": commit_of(ROOT), "steps": args.steps,
                      "rounds": args.rounds, "dtype": args.dtype, "rows": rows}
            for workload, model, batch, label, ram in configs:
                row = {"workload": workload, "budget": label, "ram": ram}
                runs: dict[str, list[dict]] = {"base": [], "head": []}
                for _ in range(args.rounds):
                    for name in runs:  # alternating, each in a fresh process
                        runs[name].append(train(trees[name], model, batch, ram, args.steps, data,
                                                tmp / f"{workload}-{label}-{name}", args.dtype))
                        print(f"{workload} {label} {name}: {runs[name][-1]}", flush=True)
                for name, rounds in runs.items():
                    row[name] = over_rounds(rounds)
                head = row["head"]
                if "step_s" in row["base"] and "step_s" in head:
                    row["step_ratio"] = round(head["step_s"] / row["base"]["step_s"], 3)
                    row["peak_ratio"] = round(head["peak_gib"] / row["base"]["peak_gib"], 3)
                if "step_s" in head:  # how far this tree's own prediction is off
                    row["step_error"] = round(head["predicted_step_s"] / head["step_s"] - 1, 3)
                    row["peak_error"] = round(head["predicted_peak_gib"] / head["peak_gib"] - 1,
                                              3)
                if workload == "W2" and "decisions" in head:
                    replan_row(row, ROOT, tmp / f"{workload}-{label}-head" / "disk", args.dtype)
                rows.append(row)
                write(result, RESULTS / f"against-base-{stamp}.json")  # a cut run keeps these
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)


def replan(path: Path) -> None:
    """Rerun the W2 rows' `tierflow plan` of a saved result with this tree (the training runs
    are kept), recording the commit that planned them."""
    result = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for row in result["rows"]:
            if row["workload"] == "W2" and "decisions" in row["head"]:
                replan_row(row, ROOT, Path(tmp) / "disk", result.get("dtype", "bf16"))
    result["replanned_by"] = commit_of(ROOT)
    write(result, path)


def replan_row(row: dict, tree: Path, disk: Path, dtype: str) -> None:
    """A W2 row's `tierflow plan` results (analytic, then --measure) and whether each made
    the decisions of the plan the trainer ran."""
    for key, (flags, same) in PLAN_COMMANDS.items():
        row[key] = predicted_decisions(tree, "tinyllama-1.1b", 2, row["ram"], disk, flags, dtype)
        row[same] = row[key].get("decisions") == row["head"]["decisions"]


def write(result: dict, path: Path) -> None:
    """``result`` as JSON at ``path`` and as a Markdown table beside it."""
    stamp, rows = result["date"], result["rows"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# This tree against {result['base'][:12]} ({stamp})", "",
             f"head {result['head'][:12]}; {result['cpu']}, {result['cores']} cores; "
             f"{result.get('dtype', 'bf16')} matmuls; "
             f"{result['steps']} steps, the median after the first; the median of "
             f"{result.get('rounds', 1)} fresh process(es) per tree. "
             "`benchmarks/against_base.py`.", "",
             "| workload | budget | base step s | head step s | head/base | base peak GiB | "
             "head peak GiB | head/base | head PREDICTED step s (off) | PREDICTED peak GiB "
             "(off) | `tierflow plan` the same plan (analytic; --measure) | rounds' spread, base / head "
             "| profile and plan s, base / head |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, h = r["base"], r["head"]
        if "step_s" not in b or "step_s" not in h:
            lines.append(f"| {r['workload']} | {r['budget']} | {b.get('error', '')} | "
                         f"{h.get('error', '')} | | | | | | | | | |")
            continue
        lines.append(f"| {r['workload']} | {r['budget']} ({r['ram']}) | {b['step_s']} | "
                     f"{h['step_s']} | {r['step_ratio']} | {b['peak_gib']} | {h['peak_gib']} "
                     f"| {r['peak_ratio']} | {h['predicted_step_s']} ({r['step_error']:+.0%}) | "
                     f"{h['predicted_peak_gib']} ({r['peak_error']:+.0%}) | "
                     f"{_same(r, 'plan_command')}; {_same(r, 'plan_measured')} | {_spread(b)} / {_spread(h)} "
                     f"| {b.get('planning_s', '-')} / {h.get('planning_s', '-')} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _spread(tree: dict) -> str:
    """How far a tree's slowest round is from its fastest (its runs' noise), or - with one."""
    steps = [r["step_s"] for r in tree.get("rounds", [])]
    return f"{max(steps) / min(steps) - 1:.0%}" if len(steps) > 1 else "-"


def _same(row: dict, key: str) -> str:
    """A same-plan cell of the plan command ``key``: yes, no (what differs), or - where not
    compared."""
    if key not in row:
        return "-"
    theirs = row[key].get("decisions") or {}
    differ = [k for k, v in row["head"]["decisions"].items() if theirs.get(k) != v]
    if not differ and theirs:
        return "yes"
    return "no: " + (", ".join(differ) or row[key].get("error", "?"))


if __name__ == "__main__":
    main()
