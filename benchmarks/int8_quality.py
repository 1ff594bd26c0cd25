#!/usr/bin/env python3
"""What `tierflow quantize`'s int8 copy costs in quality, on a trained model.

    .venv/bin/python benchmarks/int8_quality.py [--run runs/demo] [--batches 16] [--seq 256]

The model is the one `tierflow demo` trains (llama-20m on the Python standard library's
source; `--run` is its output directory, trained first with `tierflow demo --out RUN` when it
holds no checkpoint). The latest checkpoint is copied to int8 by `tierflow quantize`; then, in
a fresh process, both are evaluated in bf16 on the same `--batches` windows of `--seq` tokens
spread evenly over the demo's held-out tokens (RUN/data/eval.bin): the mean next-token loss,
the median relative L2 error of the int8 logits against the bf16 ones, and how often both
models rank the same token first. Writes benchmarks/results/int8-quality-<date>.{md,json}.
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
from harness import write_results  # noqa: E402

from tierflow.cli import measure  # noqa: E402

# Both models on the same windows, in a fresh process: one JSON line.
CHILD = r"""
import json, sys
import numpy as np
import torch
import torch.nn.functional as F
from tierflow import load_model
from tierflow.data.tokenfile import TokenFile
original, int8, eval_file, batches, seq = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
tokens = TokenFile.open(eval_file).tokens
starts = np.linspace(0, len(tokens) - seq - 1, batches).astype(np.int64)
windows = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64))
inputs, targets = windows[:, :-1], windows[:, 1:]  # (batches, seq) each
results, logits = {}, {}
with torch.inference_mode():
    for name, path, quantized in (("bf16", original, False), ("int8", int8, True)):
        model = load_model(path, dtype=torch.bfloat16, for_generation=quantized).eval()
        out = model(input_ids=inputs).logits.float()  # (batches, seq, vocab)
        results[name] = float(F.cross_entropy(out.flatten(0, 1), targets.flatten()))
        logits[name] = out
        del model
error = ((logits["int8"] - logits["bf16"]).norm(dim=-1) / logits["bf16"].norm(dim=-1)).median()
same = (logits["int8"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean()
print(json.dumps({"loss_bf16": round(results["bf16"], 4), "loss_int8": round(results["int8"], 4),
                  "logits_relative_error_median": round(float(error), 4),
                  "top1_agreement": round(float(same), 4), "tokens": int(targets.numel())}))
"""


def tierflow(*args: str) -> str:
    """``tierflow ARGS`` in a fresh process; its stderr's last line."""
    proc = subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    if proc.returncode != 0:
        raise SystemExit(f"tierflow {args[0]} failed:\n{proc.stderr[-3000:]}")
    return (proc.stderr.strip().splitlines() or [""])[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    from tierflow.train.checkpoint_dirs import latest_checkpoint
    if latest_checkpoint(args.run) is None:
        print(f"training the demo model into {args.run} (tierflow demo, a few minutes)",
              flush=True)
        tierflow("demo", "--out", str(args.run))
    checkpoint = latest_checkpoint(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        int8 = Path(tmp) / "int8"
        quantized = tierflow("quantize", "--model", str(checkpoint), "--out", str(int8))
        result = measure.run_json([sys.executable, "-c", CHILD, str(checkpoint), str(int8),
                                   str(args.run / "data" / "eval.bin"), str(args.batches),
                                   str(args.seq)],
                                  env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    date = dt.date.today().isoformat()
    result.update(date=date, checkpoint=str(checkpoint), quantized=quantized,
                  batches=args.batches, seq=args.seq)
    change = (result["loss_int8"] / result["loss_bf16"] - 1) * 100
    text = "\n".join([
        f"# int8 weights (`tierflow quantize`) against bf16 on a trained model ({date})", "",
        f"`tierflow demo`'s llama-20m ({checkpoint}), evaluated in bf16 on {args.batches} "
        f"windows of {args.seq} held-out tokens ({result['tokens']:,} predictions), in one "
        "fresh process.", "",
        "| weights | eval loss |", "|---|---|",
        f"| bf16 (the checkpoint) | {result['loss_bf16']:.4f} |",
        f"| int8, one scale per output channel | {result['loss_int8']:.4f} |", "",
        f"Eval loss change: **{change:+.2f}%**. Median relative L2 error of the logits: "
        f"{result['logits_relative_error_median']:.4f}; the same top token at "
        f"{result['top1_agreement'] * 100:.1f}% of the positions.", "",
        f"`tierflow quantize` printed: `{quantized}`", ""])
    write_results(args.out, f"int8-quality-{date}", text, result)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
