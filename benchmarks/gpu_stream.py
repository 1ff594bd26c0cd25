#!/usr/bin/env python3
"""Weights streamed to a CUDA GPU from page-locked host RAM, against plain PyTorch on the
same GPU, each configuration in a fresh process. Needs a CUDA GPU (none in CI: this ran on
a lent H100, see docs/benchmarks.md).

    PYTHONPATH=src python3 benchmarks/gpu_stream.py [--arch tinyllama-1.1b] [--seq 1024]
        [--batch 16] [--gpu 12GiB] [--ram 64GiB] [--steps 5] [--results DIR] [--tag TAG]

The model is a preset with a random init, trained on random tokens under bf16 autocast with
AdamW (lr 1e-4, weight decay 0.01). Configurations:
- `plain`: the whole model, its gradients and AdamW on the GPU, with Hugging Face gradient
  checkpointing (the CPU peer's `hf-ckpt` mode; `../shared/peers/peers.py` has no GPU mode);
- `stream`: `tierflow.fit(model, sample, gpu=GPU, ram=RAM, optimizer=AdamW,
  config=FitConfig(stream="all"))`: every decoder layer's weights in host RAM between uses,
  read ahead on a side stream (the optimizer states where the planner puts them);
- `stream-serial`: the same plan with every read on demand (`serial_reads=True`);
- `stream-prefetch0`: the plan made for reading nothing ahead (`prefetch_depth=0`);
- `stream-disk` (only when asked for, with `--disk DIR`): `stream` with host RAM cut to
  `--disk-ram` and the disk directory below it (GPU, RAM, disk);
- `stream-host` and `stream-gpu-update` (only when asked for): `stream` with every stage
  AdamW can step in host RAM stepped there (`host_updates="all"`), and with every update on
  the GPU (`host_updates="never"`);
- `stream-disk-host` and `stream-disk-gpu-update` (only when asked for, with `--disk DIR`):
  `stream-disk` with the AdamW states on disk (`optimizer_states="disk"`), stepped in host
  RAM where AdamW can (`host_updates="all"`: the states come up to host RAM for the step),
  or every stage updated on the GPU (`"never"`: the states come up to the GPU);
- `host-start` (only when asked for): the model built in host RAM, not on the GPU, and
  fitted under `--host-start-gpu` with the planner's choice of what streams
  (`stream="auto"`): fit moves it to the GPU empty and streams what does not fit.
Reported: the median step of the steps after the first (the GPU synchronized at each end),
tok/s and the ratio to `plain`, the GPU's peak allocated and reserved bytes, and the
PREDICTED step and peak of tierflow's plan.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("plain", "stream", "stream-serial", "stream-prefetch0", "stream-disk", "host-start",
           "stream-host", "stream-gpu-update", "stream-disk-host", "stream-disk-gpu-update")
DEFAULT_CONFIGS = CONFIGS[:4]


def run_one(config: str, args: argparse.Namespace) -> dict:
    """One configuration's steps in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    import tierflow
    from tierflow import FitConfig
    from tierflow.exec.trace import recording
    from tierflow.models.presets import preset_config

    device = torch.device("cpu" if args.simulate else "cuda")
    gpu = torch.cuda if device.type == "cuda" else None
    torch.manual_seed(0)
    with torch.device("cpu") if config == "host-start" else device:
        model = AutoModelForCausalLM.from_config(preset_config(args.arch))
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    sample = {"input_ids": tokens, "labels": tokens}

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    plan = {}
    if config == "plain":
        model.gradient_checkpointing_enable()
        optimizer = adamw(model.parameters())

        def step() -> float:
            with autocast:
                loss = model(**sample).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()
    else:
        options = {"stream-serial": {"serial_reads": True},
                   "stream-prefetch0": {"prefetch_depth": 0},
                   "stream-host": {"host_updates": "all"},
                   "stream-gpu-update": {"host_updates": "never"},
                   "stream-disk-host": {"host_updates": "all", "optimizer_states": "disk"},
                   "stream-disk-gpu-update": {"host_updates": "never",
                                              "optimizer_states": "disk"}}.get(config, {})
        tiers = {"ram": args.disk_ram, "disk": args.disk} \
            if config.startswith("stream-disk") else {"ram": args.ram}
        host_start = config == "host-start"
        with autocast:
            module = tierflow.fit(model, sample, optimizer=adamw, **tiers,
                                  gpu=args.host_start_gpu if host_start else args.gpu,
                                  config=FitConfig(stream="auto" if host_start else "all",
                                                   simulated_gpu=args.simulate, **options))
        plan = {"strategy": module.plan.strategy,
                "predicted_step_s": round(module.plan.predicted_time, 3),
                "predicted_peak_gib": round(module.plan.predicted_peak / 2**30, 2),
                "streamed_stages": len(module.streamer.stage_params) if module.streamer else 0,
                "host_updated_stages": len(module.optimizer.host.stages)
                if module.optimizer.host else 0,
                "placement": placement(module.plan.costs.extra),
                "explain": module.plan.explain()}

        def step() -> float:
            with autocast:
                loss = module(**sample).loss
            loss.backward()
            return loss.item()
    if gpu:
        gpu.synchronize()
        gpu.reset_peak_memory_stats()
    times, losses = [], []
    trace = args.trace and config != "plain"
    with recording() if trace else contextlib.nullcontext() as recorder:
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            losses.append(step())
            if gpu:
                gpu.synchronize()
            times.append(time.perf_counter() - start)
    if trace:  # the measured spans beside the plan's predicted timeline, per resource
        timeline = module.plan.timeline
        recorder.write(Path(args.trace) / f"trace-b{args.batch}-{config}.json", timeline)
        micro = max(1, len(recorder.micro_batches()))
        plan["busy_s_predicted_measured"] = {
            row: [round(timeline.busy(row), 4), round(recorder.working_seconds(row) / micro, 4)]
            for row in sorted({s.resource for s in timeline.spans})}
    median = statistics.median(times[1:])
    peaks = {"gpu_peak_allocated_gib": round(gpu.max_memory_allocated() / 2**30, 2),
             "gpu_peak_reserved_gib": round(gpu.max_memory_reserved() / 2**30, 2)} if gpu else {}
    return {"config": config, "step_s": round(median, 3), "steps_s": [round(t, 3) for t in times],
            "tok_s": round(args.batch * args.seq / median, 1),
            "losses": [round(x, 4) for x in losses], **peaks, **plan}


def placement(extra: dict) -> str:
    """Where a plan keeps the streamed weights and the optimizer states, in a few words."""
    states = next((k.removeprefix("optimizer states on ") for k in extra
                   if k.startswith("optimizer states on ")), "gpu")
    return f"weights: {extra.get('weights tier', 'gpu')}, states: {states}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="tinyllama-1.1b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--gpu", default="12GiB", help="tierflow's GPU budget")
    parser.add_argument("--ram", default="64GiB", help="tierflow's host RAM budget")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"some of {','.join(CONFIGS)}")
    parser.add_argument("--disk", help="the disk tier's directory (stream-disk*)")
    parser.add_argument("--disk-ram", default="6GiB", help="host RAM budget of stream-disk*")
    parser.add_argument("--host-start-gpu", default="4GiB", help="GPU budget of host-start")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in every run "
                             "(what tierflow train --gpu sets)")
    parser.add_argument("--trace", help="a folder: each tierflow configuration's steps as a "
                                         "Chrome trace there, the plan's predicted timeline "
                                         "beside them")
    parser.add_argument("--simulate", action="store_true",
                        help="run on the CPU as a simulated GPU (a check of the script)")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # the child's run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")]))
    if args.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, "--one", config, *sys.argv[1:]]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"config": config, "error": proc.stderr.strip().splitlines()[-1:]})
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "explain"}), flush=True)
    write_results(rows, args)


def write_results(rows: list[dict], args: argparse.Namespace) -> None:
    import torch

    plain = next((r for r in rows if r["config"] == "plain" and "step_s" in r), None)
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    where = "a simulated GPU on the CPU" if args.simulate else torch.cuda.get_device_name()
    lines = [f"# Weights streamed to the GPU ({stamp}, {where})", "",
             f"`{args.arch}`, seq {args.seq}, batch {args.batch}, bf16 autocast, AdamW; "
             f"tierflow under `gpu={args.gpu}, ram={args.ram}` (stream-disk: "
             f"`ram={args.disk_ram}` and a disk directory); {args.steps} steps after a "
             "warm-up, median" + ("; the caching allocator with expandable segments"
                                  if args.expandable_segments else "") +
             ". `benchmarks/gpu_stream.py`.", "",
             "| config | placement | step s | tok/s | vs plain | GPU peak allocated / reserved "
             "GiB | PREDICTED step s | PREDICTED peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['config']} | failed: {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tok_s'] / plain['tok_s']:.2f}x" if plain else "-"
        lines.append(f"| {r['config']} | {r.get('placement', '-')} | {r['step_s']} | "
                     f"{r['tok_s']} | {ratio} | "
                     f"{r.get('gpu_peak_allocated_gib', '-')} / "
                     f"{r.get('gpu_peak_reserved_gib', '-')} | "
                     f"{r.get('predicted_step_s', '-')} | {r.get('predicted_peak_gib', '-')} |")
    steps = {r["config"]: r["step_s"] for r in rows if "step_s" in r}
    if {"stream", "stream-serial", "stream-prefetch0"} <= set(steps):
        lines += ["", f"Overlap: the streamed step takes "
                      f"{steps['stream'] / steps['stream-prefetch0']:.2f}x the step without "
                      f"read-ahead and {steps['stream'] / steps['stream-serial']:.2f}x the same "
                      "plan with its reads on demand."]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"gpu-stream-{stamp}.md").write_text("\n".join(lines) + "\n")
    (results / f"gpu-stream-{stamp}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
