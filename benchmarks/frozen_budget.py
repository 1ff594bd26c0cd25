#!/usr/bin/env python3
"""Fine-tuning the last decoder layers of a Llama with the rest frozen: the RAM it needs.

    .venv/bin/python benchmarks/frozen_budget.py [--arch llama-134m] [--seq 512] [--batch 2]
        [--trainable-layers 2] [--steps 3] [--built-on-disk]

Three models, each in fresh processes: the whole model trainable; everything frozen
(`requires_grad` False) but the last `--trainable-layers` decoder layers, the final norm and
the head, as a partial fine-tune is set up; and the same with the head frozen too. For each,
the smallest `ram` that `tierflow.fit` finds with a disk tier (from its one-line refusal of
1 MiB), then `--steps` steps (after one warm-up step) at the budget that refusal says to
give a new process; and the same steps in plain PyTorch with the same parameters frozen (no
budget). Peaks are counted as `ram` counts them: the RSS above the process's RSS before
training less the weights it holds (the model built, malloc's free memory returned, the peak
reset there), so the building of the model is outside. tierflow's peak is given for its
steps (the peak reset after `fit`) and for `fit`, which starts with the model as the caller
built it: whole in RAM, which `fit` moves to the disk tier, or with `--built-on-disk` loaded
onto the disk tier from a checkpoint of the same weights (`tierflow.load_model(dir,
disk=...)`), never whole in RAM. Weights fp32 under bf16 autocast, AdamW (lr 1e-4) over the
trainable parameters, random tokens. Writes
benchmarks/results/frozen-budget-<date>[-on-disk].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from harness import source_commit, write_results  # noqa: E402

from tierflow.cli import measure  # noqa: E402
from tierflow.core.units import format_bytes  # noqa: E402

# One configuration in this fresh process: one JSON line.
CHILD = r"""
import json, statistics, sys, tempfile, time
import torch
import tierflow, tierflow.fitting.fit
from tierflow.cli import measure
from tierflow.exec.memory import return_free_memory
from tierflow.profile.machine import maxrss_bytes, reset_peak_rss
mode, arch, checkpoint = sys.argv[1:4]
seq, batch, trainable, head, steps, ram = [int(a) for a in sys.argv[4:]]
disk_tier = tempfile.TemporaryDirectory()
disk = disk_tier.name
if checkpoint and mode != "plain":  # the same weights, built onto the disk tier
    model = tierflow.load_model(checkpoint, disk=disk)
else:
    model = measure.build(arch, seq)
layers = model.config.num_hidden_layers
if trainable >= 0:  # freeze all but the last `trainable` decoder layers, the norm (and head)
    keep = tuple(f"model.layers.{i}." for i in range(layers - trainable, layers))
    keep += ("model.norm.",) + (("lm_head.",) if head else ())
    for name, p in model.named_parameters():
        if not name.startswith(keep):
            p.requires_grad_(False)
params = [p for p in model.parameters() if p.requires_grad]
tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
sample = {"input_ids": tokens, "labels": tokens}
adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)
record = {"mode": mode, "trainable_bytes": sum(p.nbytes for p in params),
          "weight_bytes": sum(p.nbytes for p in model.parameters())}
autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
resident = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}.values())  # the weights this process holds
return_free_memory()
reset_peak_rss()
base = maxrss_bytes() - resident  # as `ram` counts: the weights held inside
with disk_tier:
    if mode == "smallest":
        try:
            with autocast():
                tierflow.fit(model, sample, optimizer=adamw, ram=1 << 20, disk=disk)
        except tierflow.BudgetError as err:
            record.update(smallest=err.smallest, to_give=err.to_give)
        print(json.dumps(record), flush=True)
        sys.exit(0)
    if mode == "plain":
        optimizer = adamw(params)
        run = model
    else:
        with autocast():
            run = tierflow.fit(model, sample, optimizer=adamw, ram=ram, disk=disk)
        record.update(fit_peak=maxrss_bytes() - base,
                      predicted_peak=int(run.plan.predicted_peak), strategy=run.plan.strategy,
                      streamed=run.plan.costs.extra.get("streamed stages", []),
                      streamed_bytes=run.plan.costs.extra.get("streamed bytes", 0))
    reset_peak_rss()
    times, losses = [], []
    for _ in range(steps + 1):  # the first step is warm-up
        start = time.perf_counter()
        with autocast():
            loss = run(**sample).loss
        loss.backward()  # tierflow: updates inside the backward
        if mode == "plain":
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        times.append(time.perf_counter() - start)
    steps_peak = maxrss_bytes() - base
    if mode != "plain":
        run.settle()  # no write in flight as the disk directory goes
record.update(step_s=statistics.median(times[1:]), losses=losses, steps_peak=steps_peak)
print(json.dumps(record), flush=True)
"""


# --built-on-disk: the peers' model, saved once by a process of its own
SAVE = r"""
import sys
from tierflow.cli import measure
measure.build(sys.argv[1], int(sys.argv[2])).save_pretrained(sys.argv[3])
"""


def child(*args: object) -> dict:
    return measure.run_json([sys.executable, "-c", CHILD, *map(str, args)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(measure.ARCHS), default="llama-134m")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--trainable-layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--built-on-disk", action="store_true",
                   help="tierflow's processes load the model onto the disk tier "
                        "(tierflow.load_model(dir, disk=...)) instead of building it in RAM")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as saved:
        checkpoint = ""
        if args.built_on_disk:
            checkpoint = str(Path(saved) / "model")
            subprocess.run([sys.executable, "-c", SAVE, args.arch, str(args.seq), checkpoint],
                           check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        rows = _rows(args, checkpoint)
    _write(args, rows)
    return 0


def _rows(args: argparse.Namespace, checkpoint: str) -> list[dict]:
    """Each model's smallest budget, tierflow's steps at the budget to give, plain PyTorch's."""
    shape = (args.arch, checkpoint, args.seq, args.batch)
    rows = []
    n = args.trainable_layers
    for name, trainable, head in (("whole model", -1, 1), (f"last {n} layers + head", n, 1),
                                  (f"last {n} layers (head frozen)", n, 0)):
        found = child("smallest", *shape, trainable, head, 0, 0)
        print(f"{name}: smallest ram {format_bytes(found['smallest'])}", flush=True)
        ours = child("tierflow", *shape, trainable, head, args.steps, found["to_give"])
        plain = child("plain", *shape, trainable, head, args.steps, 0)
        print(f"  tierflow at {format_bytes(found['to_give'])}: "
              f"{format_bytes(ours['steps_peak'])} peak in steps "
              f"({format_bytes(ours['fit_peak'])} in fit), {ours['step_s']:.2f} s; "
              f"plain PyTorch {format_bytes(plain['steps_peak'])}, "
              f"{plain['step_s']:.2f} s", flush=True)
        rows.append({"model": name, "trainable_layers": trainable, "head": bool(head), **found,
                     "tierflow": ours, "plain": plain})
    return rows


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    """The .md table and the .json of the rows."""
    date = dt.date.today().isoformat()
    result = {"date": date, "commit": source_commit(ROOT), "arch": args.arch,
              "seq": args.seq, "batch": args.batch, "steps": args.steps,
              "built_on_disk": args.built_on_disk, "rows": rows}
    where = ("tierflow's model loaded onto the disk tier (`tierflow.load_model(dir, disk=...)`)"
             if args.built_on_disk else "every model built in RAM")
    lines = [f"# Partial fine-tuning: the RAM it needs ({date}, commit {result['commit']})", "",
             f"{args.arch}, seq {args.seq}, batch {args.batch}, fp32 weights under bf16 "
             f"autocast, AdamW over the trainable parameters; {where}; each cell a fresh "
             f"process; step times are medians of {args.steps} steps after a warm-up step.", "",
             "| trainable | trainable bytes | smallest `ram` (fit) | tierflow at the given "
             "`ram`: steps' peak (fit's), step | streamed stages | plain PyTorch: peak, step |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ours, plain = row["tierflow"], row["plain"]
        lines.append(
            f"| {row['model']} | {format_bytes(ours['trainable_bytes'])} of "
            f"{format_bytes(ours['weight_bytes'])} | {format_bytes(row['smallest'])} | "
            f"{format_bytes(ours['steps_peak'])} at {format_bytes(row['to_give'])} "
            f"({format_bytes(ours['fit_peak'])} in fit), "
            f"{ours['step_s']:.2f} s | {len(ours['streamed'])} "
            f"({format_bytes(ours['streamed_bytes'])}) | "
            f"{format_bytes(plain['steps_peak'])}, {plain['step_s']:.2f} s |")
    text = "\n".join(lines) + "\n"
    name = f"frozen-budget-{date}" + ("-on-disk" if args.built_on_disk else "")
    write_results(args.out, name, text, result)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
