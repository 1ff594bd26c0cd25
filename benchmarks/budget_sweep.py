#!/usr/bin/env python3
"""Whether every run keeps its RAM budget (issue 43): models x modes x budgets, each run a
fresh process, the peak RSS above the post-import baseline against the budget.

    .venv/bin/python benchmarks/budget_sweep.py [--short] [--enforce] [--models A,B]
        [--modes ram,disk,...] [--budgets 25,50,75,100,smallest] [--steps 2] [--out DIR]
        [--tag TAG]

Per model and mode, plain PyTorch is measured first (``budget_sweep_child.py plain``: the
same model, precision, batch and frozen parameters, AdamW, no tierflow); the budgets are
fractions of its peak, and ``smallest`` is the smallest budget tierflow names for the run
(its ``give --ram`` after a refusal at 1 MiB). The language models train with ``tierflow
train`` on random token ids (its step records' ``ram_bytes``: the peak RSS above the
post-import baseline, profiling included); the ResNet through ``tierflow.fit``
(``budget_sweep_child.py fit``). A budget no plan fits is recorded as refused, with the
smallest that works; with ``--enforce`` the runs hold their budget in a memory cgroup, and
a run the kernel killed is recorded as such.

Models: llama-20m, llama-134m and gpt2-124m (presets, random init), ``qwen2-tiny`` (a Qwen2
checkpoint built here with ``save_pretrained``: 4 layers, hidden 256) and ``resnet`` (a
ResNet of basic blocks, 32 images of 128x128). Modes: ``ram`` (in RAM), ``disk`` (``--disk``),
``bf16`` (bf16 weights and AdamW moments), ``accum`` (``--grad-accum 2``), ``frozen``
(the first two decoder layers frozen) and ``generate`` (``tierflow generate`` of the model
saved in bf16, 16 greedy tokens after a short prompt, against Hugging Face ``generate`` with
every weight in RAM); the ResNet runs in RAM only.

``--short`` is the suite's form (tests/test_budget_sweep.py): ``llama-tiny`` in RAM at the
smallest budget, one step: two processes (the refusal at 1 MiB, then the run), a few seconds
of work each beside their start. The
results go to ``--out`` (default benchmarks/results) as budget-sweep-DATE[-short].{json,md},
with the machine (CPU model, cores, memory, torch) named.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
from generate_enforce import TIERFLOW_CHILD  # noqa: E402
from harness import machine, predicted_ram_peak, source_commit, write_results  # noqa: E402
from random_tokens import random_token_files  # noqa: E402

from tierflow.core.units import format_bytes, parse_bytes  # noqa: E402

MODELS = ("llama-20m", "llama-134m", "gpt2-124m", "qwen2-tiny", "resnet")
MODES = {"ram": [], "disk": None, "bf16": ["--model-dtype", "bf16", "--optim-dtype", "bf16"],
         "accum": ["--grad-accum", "2"], "frozen": ["--freeze", "*.0.*,*.1.*"],
         "generate": None}
NEW_TOKENS = 16  # generate: greedy tokens after a 16-token prompt, bf16
BUDGETS = ("25", "50", "75", "100", "smallest")
SEQ, BATCH = 256, 4
# the suite's form: the smallest budget of a tiny Llama (plain PyTorch's peak, which only the
# fractions need, is not measured: tierflow's runtime alone passes that model's 110 MiB)
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank"
SHORT = {"models": ("llama-tiny",), "modes": ("ram",), "budgets": ("smallest",), "steps": 1}


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def _child_json(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"a child failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return json.loads(lines[-1])


def plain_peak(model: str, mode: str, spec: str, steps: int, timeout: float) -> dict[str, Any]:
    """Plain PyTorch's record for ``model`` in ``mode`` (its peak RSS above the baseline;
    generate: Hugging Face ``generate`` with every weight in RAM)."""
    argv = [sys.executable, str(HERE / "budget_sweep_child.py"), "plain", "--model", spec,
            "--mode", mode, "--seq", str(SEQ), "--batch", str(BATCH), "--steps", str(steps),
            "--new-tokens", str(NEW_TOKENS), "--prompt", PROMPT]
    return _child_json(_run(argv, timeout))


def tierflow_run(model: str, mode: str, spec: str, ram: int, steps: int, enforce: bool,
                 scratch: Path, data: Path | None, timeout: float) -> dict[str, Any]:
    """One run of tierflow under ``ram`` bytes: ok (peak, predicted), refused (smallest) or
    killed (by the kernel under --enforce)."""
    if model == "resnet":
        argv = [sys.executable, str(HERE / "budget_sweep_child.py"), "fit", "--model", spec,
                "--ram", str(ram), "--steps", str(steps)] + (["--enforce"] if enforce else [])
        proc = _run(argv, timeout)
        if proc.returncode == 0:
            return _child_json(proc)
    elif mode == "generate":  # spec: a checkpoint directory (generate_checkpoint)
        argv = [sys.executable, "-c", TIERFLOW_CHILD, "generate", "--model", spec, "--prompt",
                PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--dtype",
                "bf16", "--ram", f"{ram}B"] + (["--enforce"] if enforce else [])
        proc = _run(argv, timeout)
        if proc.returncode == 0:
            rss = json.loads(next(x for x in proc.stderr.splitlines()
                                  if x.startswith('{"baseline')))
            streamed = [x for x in proc.stderr.splitlines() if x.startswith("[stream]")]
            return {"status": "ok", "budget": ram, "peak_above_baseline_bytes":
                    rss["peak_rss_bytes"] - rss["baseline_rss_bytes"],
                    "strategy": "streamed" if streamed else "in RAM"}
    else:
        out = Path(tempfile.mkdtemp(dir=scratch))
        flags = MODES[mode] if mode != "disk" else ["--disk", str(scratch)]
        argv = [sys.executable, "-m", "tierflow", "train", "--model", spec, "--data", str(data),
                "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--steps", str(steps),
                "--ram", str(ram) + "B", "--eval-every", "0", "--warmup", "0", "--out",
                str(out), *flags] + (["--enforce"] if enforce else [])
        proc = _run(argv, timeout)
        if proc.returncode == 0:
            records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
            plan = next(r for r in records if r["kind"] == "plan")
            return {"status": "ok", "budget": ram,
                    "peak_above_baseline_bytes": max(r["ram_bytes"] for r in records
                                                     if r["kind"] == "train"),
                    "predicted_peak_bytes": predicted_ram_peak(plan), "strategy": plan["strategy"]}
    if proc.returncode == -9:
        return {"status": "killed", "budget": ram, "stderr": proc.stderr[-500:]}
    # the budget to give, or (before the model is built) what its weights and states take
    give = re.search(r"give (?:--)?ram[= ]\"?(\d+(?:\.\d+)?) ?([KMGT]iB)", proc.stderr) or \
        re.search(r"below the (\d+(?:\.\d+)?) ([KMGT]iB) that", proc.stderr)
    if proc.returncode == 2 and give:
        return {"status": "refused", "budget": ram, "error": proc.stderr.strip()[-400:],
                "smallest": parse_bytes("".join(give.groups()))}
    # anything else is recorded, not raised: the runs before it keep their results
    return {"status": "failed", "budget": ram, "returncode": proc.returncode,
            "error": proc.stderr.strip()[-600:]}


def qwen2_tiny(directory: Path) -> Path:
    """A tiny Qwen2 checkpoint (random init, seed 0) saved with ``save_pretrained``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def generate_checkpoint(spec: str, directory: Path) -> str:
    """``spec`` (a preset or a checkpoint directory) saved in bf16 with a small tokenizer,
    in a fresh process (building it costs the sweep's own process nothing): what the
    generate mode reads."""
    code = ("import sys, torch, tierflow; from tierflow.data.tokenizer import train_tokenizer; "
            "m = tierflow.load_model(sys.argv[1], dtype=torch.bfloat16); "
            "m.save_pretrained(sys.argv[2]); "
            "train_tokenizer([sys.argv[3] * 4], 300).save(sys.argv[2] + '/tokenizer.json')")
    proc = _run([sys.executable, "-c", code, spec, str(directory), PROMPT], timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"saving {spec} for generation failed: {proc.stderr[-1500:]}")
    return str(directory)


def table(records: list[dict[str, Any]]) -> str:
    """The results as a markdown table, and the worst margin of the runs that ran."""
    rows = ["| model | mode | budget | status | peak above baseline | % of budget |",
            "|---|---|---|---|---|---|"]
    for r in records:
        peak = r.get("peak_above_baseline_bytes")
        share = f"{peak / r['budget']:.1%}" if peak else "-"
        status = r["status"] + (f" (smallest {format_bytes(r['smallest'])})"
                                if r["status"] == "refused" else "")
        rows.append(f"| {r['model']} | {r['mode']} | {r['label']} ({format_bytes(r['budget'])})"
                    f" | {status} | {format_bytes(peak) if peak else '-'} | {share} |")
    ran = [r for r in records if r["status"] == "ok"]
    if ran:
        worst = max(ran, key=lambda r: r["peak_above_baseline_bytes"] / r["budget"])
        rows.append(f"\nworst: {worst['model']} {worst['mode']} at {worst['label']}: "
                    f"{worst['peak_above_baseline_bytes'] / worst['budget']:.1%} of its budget")
    return "\n".join(rows)


def sweep(models, modes, budgets, steps: int, enforce: bool,
          timeout: float) -> list[dict[str, Any]]:
    """Every (model, mode, budget) run, in order, each in a fresh process."""
    records = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        data = random_token_files(scratch / "data", 32000, train_tokens=1 << 18, eval_tokens=0)
        specs = {m: m for m in models}
        if "qwen2-tiny" in models:
            specs["qwen2-tiny"] = str(qwen2_tiny(scratch / "qwen2-tiny"))
        for model in models:
            for mode in (("ram",) if model == "resnet" else modes):
                spec = specs[model]
                if mode == "generate":
                    spec = generate_checkpoint(spec, scratch / f"{model}-generate")
                plain = {"peak": None}
                if budgets != ["smallest"]:
                    plain = plain_peak(model, mode, spec, steps, timeout)
                    print(f"{model} {mode}: plain PyTorch {format_bytes(plain['peak'])}",
                          flush=True)
                for label in budgets:
                    ram = parse_bytes("1MiB") if label == "smallest" else \
                        int(plain["peak"] * int(label) / 100)
                    r = tierflow_run(model, mode, spec, ram, steps, enforce, scratch,
                                     data, timeout)
                    tries = 3  # 1 MiB, then what each refusal names (a floor, then the plan's)
                    while label == "smallest" and r["status"] == "refused" and tries:
                        r, tries = tierflow_run(model, mode, spec, r["smallest"], steps,
                                                enforce, scratch, data, timeout), tries - 1
                    r.update(model=model, mode=mode, label=label if label == "smallest"
                             else f"{label}%", plain_peak_bytes=plain["peak"], enforce=enforce)
                    records.append(r)
                    print(f"  {r['label']}: {r['status']} "
                          + (f"{r['peak_above_baseline_bytes'] / r['budget']:.1%} of "
                             f"{format_bytes(r['budget'])}" if r["status"] == "ok" else ""),
                          flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", action="store_true", help="the suite's form: seconds, not hours")
    p.add_argument("--enforce", action="store_true", help="every run under --enforce")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--budgets", default=",".join(BUDGETS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--tag", default="", help="a suffix for the result files' names")
    args = p.parse_args(argv)
    models, modes = args.models.split(","), args.modes.split(",")
    budgets, steps = args.budgets.split(","), args.steps
    if args.short:
        models, modes, budgets, steps = (list(SHORT["models"]), list(SHORT["modes"]),
                                         list(SHORT["budgets"]), SHORT["steps"])
    for name, given, known in (("--models", models, (*MODELS, "llama-tiny")),
                               ("--modes", modes, MODES), ("--budgets", budgets, BUDGETS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            print(f"budget_sweep: error: {name} {','.join(unknown)} is unknown: use "
                  f"{', '.join(known)}", file=sys.stderr)
            return 2
    records = sweep(models, modes, budgets, steps, args.enforce, args.timeout)
    day = datetime.date.today().isoformat()
    name = f"budget-sweep-{day}" + ("-short" if args.short else "") \
        + ("-enforce" if args.enforce else "") + (f"-{args.tag}" if args.tag else "")
    text = (f"# Budget sweep {day} ({source_commit(ROOT)})\n\n"
            f"machine: {json.dumps(machine())}\n\n{table(records)}")
    md, js = write_results(args.out, name, text, {
        "machine": machine(), "commit": source_commit(ROOT), "seq": SEQ, "batch": BATCH,
        "steps": steps, "records": records})
    print(text)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
