#!/usr/bin/env python3
"""Render the current results table from committed JSON under benchmarks/results/.

    python3 benchmarks/render_results.py            # rewrite README.md's and docs/results.md's table
    python3 benchmarks/render_results.py --check    # exit 1 when either is out of date
    python3 benchmarks/render_results.py --print    # print the table

Each row reads one result file and names the machine it ran on: the file's own ``machine``
record where it has one, else the entry for that file in ``benchmarks/results/machines.json``
(the machine section of docs/benchmarks.md, for the runs whose JSON predates that record).
The table sits between ``<!-- results:start -->`` and ``<!-- results:end -->`` in each page.
Standard library only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "README.md", ROOT / "docs" / "results.md")
START, END = "<!-- results:start -->", "<!-- results:end -->"
GIB, MIB = 2 ** 30, 2 ** 20


def load(name: str) -> Any:
    """The JSON of ``benchmarks/results/NAME``."""
    return json.loads((RESULTS / name).read_text())


def machine_of(name: str, data: Any) -> str:
    """The machine ``name`` ran on: its own record, else machines.json's entry."""
    record = data.get("machine") if isinstance(data, dict) else None
    if isinstance(record, dict):
        if "gpu" in record:
            return f"{record['gpu']}, torch {record.get('torch', '?')}"
        cpu = record.get("model_name") or record.get("cpu", "CPU")
        cores = record.get("cpus") or record.get("cores", "?")
        return f"{cores}-core {cpu}, torch {record.get('torch', '?')}"
    known = load("machines.json")
    if name not in known:
        raise SystemExit(f"render_results: {name} records no machine and machines.json has "
                         "no entry for it")
    return known[name]


def _by(rows: list[dict], key: str, value: str) -> dict:
    for row in rows:
        if row.get(key) == value:
            return row
    raise SystemExit(f"render_results: no row with {key}={value!r}")


def w1() -> tuple[str, ...]:
    name = "remat-2026-11-22.json"
    data = load(name)
    plain = _by(data["runs"], "config", "plain")
    ours = _by(data["runs"], "config", "tierflow-25%")
    w = data["workload"]
    return (f"{w['arch']} from scratch, seq {w['seq']} x batch {w['batch']}, "
            f"{w['dtype']} autocast; budget 25% of plain PyTorch's peak "
            f"({ours['budget_bytes'] / GIB:.2f} GiB)",
            f"{ours['tok_s']:.1f} tok/s in {ours['peak_above_baseline_bytes'] / GIB:.2f} GiB",
            f"plain PyTorch: {plain['tok_s']:.1f} tok/s in "
            f"{plain['peak_above_baseline_bytes'] / GIB:.2f} GiB",
            machine_of(name, data), "`./run bench --steps 5`")


def w2() -> tuple[str, ...]:
    name = "train-w2-2026-11-27-amx.json"
    rows = load(name)
    peer = _by(rows, "run", "peer: train-hf-ckpt")
    ours = _by(rows, "run", "tierflow --ram 4GiB")
    return ("tinyllama-1.1b, seq 1024 x batch 2, `--ram 4GiB --disk DIR` "
            "(weights and AdamW states on disk)",
            f"{ours['tok_s']:.1f} tok/s in {ours['peak_rss_gib']:.2f} GiB",
            f"HF gradient checkpointing: {peer['tok_s']:.1f} tok/s in "
            f"{peer['peak_rss_gib']:.2f} GiB",
            machine_of(name, rows),
            "`./run python benchmarks/train_w2.py --disk /tmp/w2disk --tag amx`")


GPU_CHECK = "gpu-check-2026-11-28-h200-llama8b-no-disk.json"  # tinyllama and the 8B, no disk
GPU_WITHIN = "gpu-check-2026-11-28-h200-llama8b-reserve.json"  # the 8B within its budgets


def gpu() -> tuple[str, ...]:
    data = load(GPU_CHECK)
    plain = _by(data["stream_b32"], "config", "plain")
    ours = _by(data["stream_b32"], "config", "stream")
    peer = data["peer_b32"]
    return ("tinyllama-1.1b on one GPU, seq 1024 x batch 32; weights and AdamW states "
            "streamed from host RAM",
            f"{ours['tok_s']:,.0f} tok/s in {ours['gpu_peak_allocated_gib']:.1f} GiB of GPU",
            f"HF gradient checkpointing: {peer['tok_s']:,.0f} tok/s in "
            f"{peer['gpu_peak_allocated_gib']:.1f} GiB; plain PyTorch {plain['tok_s']:,.0f}",
            machine_of(GPU_CHECK, data),
            "`python3 benchmarks/gpu_check.py --out OUT --peers PEERS_DIR`")


def gpu_llama8b() -> tuple[str, ...]:
    within = load(GPU_WITHIN)
    run = within["llama8b"]["splits"][0]
    over = load(GPU_CHECK)["llama8b"]["splits"][0]
    return ("Llama-3-8B on one GPU, seq 8192 x 16 sequences per step (4 x 4), bf16 weights and "
            "moments, `--gpu 24GiB --ram 60GiB`",
            f"{run['tok_s']:,.0f} tok/s with a disk tier (AdamW states there), host RAM "
            f"{run['ram_above_baseline_gib']:.1f} GiB, GPU {run['gpu_peak_allocated_gib']:.1f} "
            f"GiB; without one {over['tok_s']:,.0f} tok/s but host RAM "
            f"{over['ram_above_baseline_gib']:.1f} GiB, past the budget (now refused)",
            "published (ml_dataflow README, H100): 9,478 tok/s in these budgets",
            machine_of(GPU_WITHIN, within),
            "`python3 benchmarks/gpu_check.py --out OUT --llama8b-splits 4x4 --batches ''`")


def finetune() -> tuple[str, ...]:
    name = "frozen-budget-2026-11-25.json"
    data = load(name)
    row = _by(data["rows"], "model", "last 2 layers (head frozen)")
    ours, plain = row["tierflow"], row["plain"]
    return (f"{data['arch']}, last 2 decoder layers train, seq {data['seq']} x batch "
            f"{data['batch']}",
            f"{ours['step_s']:.2f} s/step in {ours['steps_peak'] / MIB:.0f} MiB "
            f"(smallest budget {row['smallest'] / MIB:.0f} MiB)",
            f"plain PyTorch: {plain['step_s']:.2f} s/step in "
            f"{plain['steps_peak'] / GIB:.2f} GiB",
            machine_of(name, data), "`./run python benchmarks/frozen_budget.py`")


def generate() -> tuple[str, ...]:
    name = "generate-stream-2026-11-27-amx.json"
    data = load(name)
    return (f"generation, {data['arch']} under `--ram {data['ram']}`, int8 copy "
            f"(bf16: {data['tierflow']['tok_s']:.2f} tok/s)",
            f"{data['tierflow_int8']['tok_s']:.2f} tok/s",
            f"HF + accelerate disk offload: {data['peer']['tok_s']:.2f} tok/s",
            machine_of(name, data),
            "`./run python benchmarks/generate_stream.py --tag amx`")


def prediction() -> tuple[str, ...]:
    name = "predictions-2026-11-28.json"
    rows = load(name)
    case = _by(rows, "case", "Llama-3-8B, H100, seq 8k, 24 GB device / 60 GB host")
    predicted = f"PREDICTED {case['predicted_tok_s']:,} tok/s" if case["predicted_tok_s"] \
        else f"refused: {case['refused'].split(': ', 1)[-1]}"
    return (f"`tierflow plan`: {case['case']}", predicted,
            f"published ({case['source']}): {case['published_tok_s']:,} tok/s",
            machine_of(name, rows), "`./run python benchmarks/predictions.py`")


# the budget sweep's parts (each a set of models and modes, training and generation)
SWEEP = ("budget-sweep-2026-11-28-enforce-small.json",
         "budget-sweep-2026-11-28-enforce-resnet-trim.json",
         "budget-sweep-2026-11-28-enforce-large-llama-trim.json",
         "budget-sweep-2026-11-28-enforce-large-gpt2-trim.json",
         "budget-sweep-2026-11-28-enforce-generate-large.json",
         "budget-sweep-2026-11-28-enforce-large-modes-trim.json")


def budget() -> tuple[str, ...]:
    """The worst margin of every run of the budget sweep, all under --enforce."""
    parts = [load(name) for name in SWEEP]
    records = [r for part in parts for r in part["records"]]
    ran = [r for r in records if r["status"] == "ok"]
    worst = max(ran, key=lambda r: r["peak_above_baseline_bytes"] / r["budget"])
    share = worst["peak_above_baseline_bytes"] / worst["budget"]
    count = {status: sum(r["status"] == status for r in records)
             for status in ("ok", "refused", "killed", "failed")}
    models = sorted({r["model"] for r in records})
    modes = sorted({r["mode"] for r in records})
    return (f"RAM budget under `--enforce`: {len(records)} runs of {len(models)} models "
            f"in {len(modes)} modes (training and generation) at 25-100% of plain PyTorch's "
            "peak and the smallest budget tierflow names",
            f"worst peak {share:.1%} of its budget ({worst['model']} {worst['mode']} at "
            f"{worst['label']}); {count['killed']} killed, {count['failed']} failed",
            f"{count['refused']} budgets below what a run needs refused in one line, naming "
            "the smallest",
            machine_of(SWEEP[0], parts[0]),
            "`./run python benchmarks/budget_sweep.py --enforce` (parts: `--models`, "
            "`--modes`, `--tag`)")


ROWS: tuple[Callable[[], tuple[str, ...]], ...] = (w1, w2, gpu, gpu_llama8b, finetune, generate,
                                                   prediction, budget)
SOURCES = ("remat-2026-11-22.json", "train-w2-2026-11-27-amx.json",
           GPU_CHECK, GPU_WITHIN, "frozen-budget-2026-11-25.json",
           "generate-stream-2026-11-27-amx.json", "predictions-2026-11-28.json", *SWEEP)


def table() -> str:
    """The markdown table, one row per result."""
    lines = ["| workload | tierflow | compared with | machine | reproduce |",
             "|---|---|---|---|---|"]
    for row in ROWS:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row()) + " |")
    files = ", ".join(f"`{name}`" for name in SOURCES)
    lines += ["", f"Rendered by `benchmarks/render_results.py` from {files} "
                  "under `benchmarks/results/`."]
    return "\n".join(lines)


def rendered(page: str, body: str) -> str:
    """``page`` with the text between the markers replaced by ``body``."""
    head, sep, rest = page.partition(START)
    if not sep or END not in rest:
        raise SystemExit(f"render_results: the page has no {START} ... {END} block")
    return f"{head}{START}\n{body}\n{END}{rest.partition(END)[2]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a page's table differs from the rendered one")
    parser.add_argument("--print", action="store_true", help="print the table and exit")
    args = parser.parse_args(argv)
    body = table()
    if args.print:
        print(body)
        return 0
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rendered(text, body)
        if new != text:
            if args.check:
                stale.append(page.relative_to(ROOT))
            else:
                page.write_text(new)
                print(f"render_results: wrote {page.relative_to(ROOT)}")
    if stale:
        print(f"render_results: out of date: {', '.join(map(str, stale))} "
              "(run python3 benchmarks/render_results.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
