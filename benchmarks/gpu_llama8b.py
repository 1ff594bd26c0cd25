#!/usr/bin/env python3
"""Llama-3-8B fully fine-tuned on one GPU under ``--gpu 24GiB --ram 60GiB``: the run of
issue "GPU throughput at the seeds' scale", through ``tierflow train`` as a user runs it.

    PYTHONPATH=src python3 benchmarks/gpu_llama8b.py --work DIR [--splits 4x4,8x2]
        [--steps 3] [--deadline 300] [--model llama3-8b] [--gpu 24GiB] [--ram 60GiB]
        [--seq 8192] [--no-disk [--disk-if-refused]] [--trace OUT] [--simulate-gpu]

The model is the preset at random init (seed 0) on uniformly random token ids (vocab
128,256, uint32 token files written under DIR), in ml_dataflow's "full bf16": bf16 weights,
no fp32 master (stochastic rounding), bf16 AdamW moments, bf16 matmuls. Each split
``BxA`` (B sequences per micro-batch, A micro-batches, at most 16 sequences per optimizer
step) runs in a fresh ``tierflow train`` process with a disk tier under DIR (the weights are
built there a layer at a time; the planner decides what lives in RAM), or with ``--no-disk``
without one, as the issue's ``tierflow plan`` command has none (the model is built in host
RAM; fit owns the optimizer under ``--gpu`` either way), logged with ``--log``.
Once ``--steps`` steps are logged the process is killed (SIGKILL: no checkpoint of 48 GB is
written; its disk tier is removed), so a split costs its build, its plan and its steps.

Reported per split, from the trainer's own log: the plan it ran (PREDICTED step time and
peak), every step's time (optimizer included), tok/s as the median of the steps after the
first, the GPU allocator's peak allocated and reserved bytes, the peak RSS above the
trainer's baseline and the whole process's (``wait4``'s maximum resident set), and model
FLOPs per token (the trainer's own count). The last line printed is the JSON of everything;
``gpu_check.py`` runs this as one of its parts. ``--simulate-gpu`` runs the same on the CPU
(a small ``--model``) to try the driver without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trace_stats import rss_peak  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128256  # Llama 3's: token files of uint32 ids


def write_random_tokens(directory: Path, tokens: int) -> Path:
    """``directory``/train.bin and eval.bin of uniformly random ids (tierflow's format)."""
    import numpy as np
    from tierflow.data.tokenfile import write_tokens

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("train.bin", tokens), ("eval.bin", 1 << 14)):
        if not (directory / name).exists():
            write_tokens(directory / name, rng.integers(0, VOCAB, count, dtype=np.uint32), VOCAB)
    return directory


def read_log(path: Path) -> list[dict]:
    """The records of a ``--log`` JSONL file written so far (a torn last line skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def run_split(args: argparse.Namespace, data: Path, batch: int, accum: int,
              limit_s: float, with_disk: bool) -> dict:
    """One ``tierflow train`` process for ``batch`` x ``accum`` sequences per step (with a disk
    tier below host RAM or not), killed once ``args.steps`` steps are logged or ``limit_s``
    has passed; what its log says."""
    work = Path(args.work) / f"b{batch}x{accum}"
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    log = work / "log.jsonl"
    log.unlink(missing_ok=True)
    tiers = ["--disk", str(disk)] if with_disk else []
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", args.model, "--data", str(data),
           "--gpu", args.gpu, "--ram", args.ram, *tiers, "--seq-len", str(args.seq),
           "--batch-size", str(batch), "--grad-accum", str(accum), "--model-dtype", "bf16",
           "--master", "none", "--optim-dtype", "bf16", "--matmul-dtype", "bf16",
           "--steps", str(args.steps + 1), "--warmup", "0", "--eval-every", "0",
           "--log", str(log), "--out", str(work / "out"),
           *(["--trace", str(work / "trace.json")] if args.trace else []),
           *(["--simulate-gpu"] if args.simulate_gpu else [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    start = time.monotonic()
    with open(work / "output.log", "w") as output:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stopped = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:  # the process has ended
                break
            records = read_log(log)
            steps = [r for r in records if r.get("kind") == "train"]
            # traced, the trainer writes its trace once its steps are done, then the record
            done = any(r.get("kind") == "trace" for r in records) if args.trace \
                else len(steps) >= args.steps
            if done or time.monotonic() - start > limit_s:
                stopped = "measured" if done else "time limit"
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
        proc.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(disk, ignore_errors=True)  # a killed trainer leaves its disk tier behind
    records = read_log(log)
    steps = [r for r in records if r.get("kind") == "train"][:args.steps]
    plan = next((r for r in records if r.get("kind") == "plan"), {})
    system = next((r for r in records if r.get("kind") == "system"), {})
    row: dict = {"split": f"{batch}x{accum}", "batch": batch, "grad_accum": accum,
                 "disk_tier": with_disk,
                 "wall_s": round(time.monotonic() - start, 1), "stopped": stopped,
                 "rc": None if stopped else proc.returncode,
                 "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2),
                 "output_tail": (work / "output.log").read_text()[-800:] if not steps else None}
    row["plan_text"] = plan_block((work / "output.log").read_text())
    # whether the host AdamW stepped operation by operation (the 8B step was bound by it)
    from tierflow.precision.fused_adamw import UNFUSED
    row["host_adamw_unfused"] = UNFUSED in (work / "output.log").read_text()
    traced = next((r for r in records if r.get("kind") == "trace"), None)
    if traced is not None:
        kept = Path(args.trace) / f"trace-llama8b-{batch}x{accum}.json"
        shutil.copyfile(traced["path"], kept)
        row["trace"] = {"file": kept.name, "micro_batches": traced["micro_batches"],
                        "busy_s_per_micro_batch": traced["busy_s"],
                        "rss_peak": rss_peak(kept)}
    if plan:
        row["plan"] = {"strategy": plan.get("strategy"),
                       "predicted_step_s": plan.get("predicted_step_s"),
                       "predicted_peak_gib": round(plan.get("predicted_peak", 0) / 2**30, 2),
                       "decisions": plan.get("decisions")}
    if steps:
        tokens = batch * accum * args.seq
        timed = [r["ms"] / 1e3 for r in steps[1:]] or [steps[0]["ms"] / 1e3]
        step_s = statistics.median(timed)
        peak = system.get("peak_matmul_flops") or 0
        sol = statistics.median(r["sol"] for r in steps[1:] or steps) if steps[0].get("sol") \
            else None
        row.update({
            "steps_s": [round(r["ms"] / 1e3, 3) for r in steps],
            "step_s": round(step_s, 3), "tok_s": round(tokens / step_s, 1),
            "flops_per_token": round(sol * step_s * peak / tokens) if sol and peak else None,
            "trainer_peak_matmul_tflops": round(peak / 1e12, 1) if peak else None,
            "gpu_peak_allocated_gib": _gib(max((r.get("gpu_bytes") or 0) for r in steps)),
            "gpu_peak_reserved_gib": _gib(max((r.get("gpu_reserved_bytes") or 0) for r in steps)),
            "ram_above_baseline_gib": _gib(max((r.get("ram_bytes") or 0) for r in steps)),
            "rss_baseline_gib": _gib(system.get("rss_baseline_bytes") or 0),
            "losses": [round(r["loss"], 4) for r in steps]})
        if plan.get("predicted_step_s"):
            row["predicted_tok_s"] = round(tokens / plan["predicted_step_s"], 1)
            row["measured_over_predicted"] = round(plan["predicted_step_s"] / step_s, 3)
    return row


def plan_block(output: str) -> str | None:
    """The trainer's ``[Plan]`` block (its first), as printed."""
    lines = output.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith("[Plan")), None)
    if start is None:
        return None
    end = next((k for k in range(start + 1, len(lines)) if not lines[k].strip()), len(lines))
    return "\n".join(lines[start:end])


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="scratch folder: token files, disk tiers")
    parser.add_argument("--splits", default="4x4,8x2",
                        help="comma-separated BxA: sequences per micro-batch x micro-batches")
    parser.add_argument("--steps", type=int, default=3, help="steps measured per split")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds for all splits")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpu", default="24GiB")
    parser.add_argument("--ram", default="60GiB")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--no-disk", action="store_true",
                        help="no disk tier: host RAM is the only tier below the GPU")
    parser.add_argument("--disk-if-refused", action="store_true",
                        help="with --no-disk: a split the trainer refuses (exit code 2) runs "
                             "again with a disk tier in the time left")
    parser.add_argument("--simulate-gpu", action="store_true", help="on the CPU (a small model)")
    parser.add_argument("--trace", help="a folder: each split's Chrome trace of its steps "
                                        "there (the steps' figures then include the "
                                        "recording), its busy seconds per resource and where "
                                        "its RSS peaked in the JSON")
    args = parser.parse_args()
    end = time.monotonic() + args.deadline
    splits = [tuple(map(int, s.split("x"))) for s in args.splits.split(",")]
    most = max(b * a for b, a in splits)
    data = write_random_tokens(Path(args.work) / "data", most * args.seq * (args.steps + 2))
    rows = []
    for batch, accum in splits:
        left = end - time.monotonic()
        if left < 60:
            rows.append({"split": f"{batch}x{accum}", "skipped": f"{left:.0f} s left"})
            continue
        rows.append(run_split(args, data, batch, accum, left, not args.no_disk))
        print(json.dumps(rows[-1]), flush=True)
        left = end - time.monotonic()
        if args.no_disk and args.disk_if_refused and rows[-1]["rc"] == 2 and left >= 60:
            rows.append(run_split(args, data, batch, accum, left, True))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"model": args.model, "gpu": args.gpu, "ram": args.ram, "seq": args.seq,
                      "disk_tier": not args.no_disk,
                      "precision": "bf16 weights, master none, bf16 moments, bf16 matmuls",
                      "splits": rows}))


if __name__ == "__main__":
    main()
