#!/usr/bin/env python3
"""tierflow's predictions beside published single-GPU training throughputs.

    ./run python benchmarks/predictions.py [--out benchmarks/results]

Each case is what `tierflow plan` predicts (the same `predict()`), with the setup the
publication states and, where it does not, the assumption written in the case. Prints a
markdown table (the one in docs/predictions.md) and writes
benchmarks/results/predictions-<date>.{md,json}. Needs no GPU and runs in seconds.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from tierflow.core.units import format_bytes
from tierflow.plan.placement import PlacementError
from tierflow.precision.config import PrecisionConfig
from tierflow.sim.hardware import PUBLISHED
from tierflow.sim.predict import predict
from tierflow.sim.setup import Setup
from tierflow.sim.shapes import load_shape, shape_from_config

GIB = 2 ** 30
# Qwen/Qwen2.5-7B's config.json (the shape only): no preset of ours is that size
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "tie_word_embeddings": False}
PURE_BF16 = PrecisionConfig("bf16", "none", "bf16", "bf16")  # 8 bytes/parameter


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    published: float  # tokens/s
    setup: Setup
    assumptions: str


def cases() -> list[Case]:
    h100, rtx4090 = PUBLISHED["h100-sxm"], PUBLISHED["rtx4090"]
    llama8b = load_shape("llama3-8b")
    return [
        Case("Llama-3-8B, H100, seq 8k, 78 GB device / 75 GB host", "ml_dataflow README",
             11406, Setup(llama8b, h100, 8192, 1, 16, gpu=78 * GIB, ram=75 * GIB,
                          precision=PURE_BF16),
             "full bf16 with bf16 AdamW states (ml_dataflow's 'full bf16'), GB = 2^30 bytes as "
             "ml_dataflow defines it; 16 sequences per step (not stated)"),
        Case("Llama-3-8B, H100, seq 8k, 24 GB device / 60 GB host", "ml_dataflow README",
             9478, Setup(llama8b, h100, 8192, 1, 16, gpu=24 * GIB, ram=60 * GIB,
                         precision=PURE_BF16),
             "as above"),
        Case("Qwen2.5-0.5B, RTX 4090, bf16", "llm.q README", 40000,
             Setup(load_shape("qwen2.5-0.5b"), rtx4090, 1024, 8, 8, gpu=24 * GIB, ram=64 * GIB,
                   precision=PURE_BF16),
             "batch 8 x grad-accum 8 x seq 1024 as in llm.q's example run, bf16 moments, "
             "64 GiB host RAM (not stated)"),
        Case("Qwen2.5-7B, H100, fp8 matmuls", "llm.q README", 19000,
             Setup(shape_from_config(QWEN25_7B, "qwen2.5-7b"), h100, 1024, 16, 4, gpu=80 * GIB,
                   ram=128 * GIB,
                   precision=PrecisionConfig("bf16", "none", "bf16", "fp8")),
             "seq 1024, batch 16 x grad-accum 4, bf16 moments, 128 GiB host RAM (not stated)"),
        Case("Llama-3.1-8B full fine-tune, RTX 4090, 18.9 GiB", "torchtune README", 1650,
             Setup(llama8b, rtx4090, 2048, 2, 1, gpu=int(18.9 * GIB), ram=64 * GIB,
                   precision=PrecisionConfig("bf16", "none", "int8", "bf16"), clips=False),
             "torchtune's single-device recipe: bf16 weights, 8-bit paged AdamW, optimizer "
             "in backward (so no clipping: tierflow's updates inside the backward too); "
             "batch 2 x seq 2048 and 64 GiB host RAM (not stated)"),
    ]


def run() -> list[dict]:
    rows = []
    for case in cases():
        try:
            p = predict(case.setup)
        except PlacementError as refused:  # what `tierflow plan` prints, its one line
            rows.append({"case": case.name, "source": case.source,
                         "published_tok_s": case.published, "predicted_tok_s": None,
                         "refused": str(refused), "assumptions": case.assumptions})
            continue
        pl = p.placement
        rows.append({"case": case.name, "source": case.source, "published_tok_s": case.published,
                     "predicted_tok_s": round(p.tokens_per_second),
                     "error": round(p.tokens_per_second / case.published - 1, 3),
                     "mfu": round(p.mfu, 3), "bottleneck": pl.bottleneck,
                     "placement": {k: pl.describe(k) for k in ("weights", "grads", "optimizer")},
                     "activations": pl.activations, "prefetch": pl.prefetch,
                     "peaks": {t: format_bytes(v) for t, v in pl.peaks.items()},
                     "precision": p.precision, "assumptions": case.assumptions})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [("| case | source | published tok/s | PREDICTED tok/s | error | predicted MFU | "
              "weights / optimizer states / activations | bottleneck |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["predicted_tok_s"] is None:
            lines.append(f"| {r['case']} | {r['source']} | {r['published_tok_s']:,.0f} | "
                         f"refused: {r['refused']} | | | | |")
            continue
        where = (f"{r['placement']['weights']} / {r['placement']['optimizer']} / "
                 f"{r['activations']}")
        lines.append(f"| {r['case']} | {r['source']} | {r['published_tok_s']:,.0f} | "
                     f"{r['predicted_tok_s']:,} | {100 * r['error']:+.0f}% | "
                     f"{100 * r['mfu']:.0f}% | {where} | {r['bottleneck']} |")
    lines += ["", "Assumptions per case:", ""]
    lines += [f"- {r['case']}: {r['assumptions']}" + (f"; {r['precision']}." if "precision" in r
                                                       else ".") for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    rows = run()
    table = markdown(rows)
    print(table)
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"predictions-{date}.md").write_text(table + "\n")
    (args.out / f"predictions-{date}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
