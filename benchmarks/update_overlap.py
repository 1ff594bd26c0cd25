#!/usr/bin/env python3
"""Would running a stage's AdamW update beside the next stage's backward shorten the step?

    ./run python benchmarks/update_overlap.py [--repeats 5]

Issue 4 asks for updates "overlapped with the backward of the stages before it". tierflow's
executor runs Update(i) on the main thread between Backward(i) and Backward(i-1): the
optimizer states' reads and writes overlap compute, but the AdamW arithmetic does not. This
measures, for one tinyllama-1.1b decoder layer (batch 2, seq 1024, bf16 autocast, fp32
weights: the W2 setting), the layer's backward alone, the trainer's AdamW step on a layer's
44M fp32 parameters alone, and both at once (the update on a second Python thread, as an
executor that overlapped them would run it), each the median of the repeats after a warm-up.
If the pair at once takes about the sum of the two, overlapping cannot pay on this machine:
the two share its cores. Writes benchmarks/results/update-overlap-<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks" / "results"


def measure(repeats: int) -> dict:
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tierflow.models.presets import preset_config
    from tierflow.precision.apply import make_optimizer
    from tierflow.precision.config import PrecisionConfig

    config = preset_config("tinyllama-1.1b")
    config._attn_implementation = "sdpa"
    layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    updated = LlamaDecoderLayer(config, 1)  # the stage whose update would run alongside
    optimizer = make_optimizer(updated.parameters(), PrecisionConfig(), lr=1e-4)
    for p in updated.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    x = torch.randn(2, 1024, config.hidden_size, requires_grad=True)  # (batch, seq, hidden)
    positions = torch.arange(1024)[None].expand(2, -1)  # (batch, seq)

    def taped_output() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, position_embeddings=rope(x, positions))
        return out[0] if isinstance(out, tuple) else out  # (batch, seq, hidden)

    def backward(out: torch.Tensor) -> None:
        out.float().sum().backward()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def both(out: torch.Tensor) -> None:
        worker = threading.Thread(target=optimizer.step)
        worker.start()
        backward(out)
        worker.join()

    rounds: dict[str, list[float]] = {"backward": [], "update": [], "both at once": []}
    for _ in range(repeats + 1):
        out = taped_output()
        rounds["backward"].append(timed(lambda: backward(out)))
        rounds["update"].append(timed(optimizer.step))
        out = taped_output()
        rounds["both at once"].append(timed(lambda: both(out)))
    medians = {name: statistics.median(values[1:]) for name, values in rounds.items()}
    return {"seconds": medians, "threads": torch.get_num_threads(),
            "updated_parameters": sum(p.numel() for p in updated.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.repeats)
    s = result["seconds"]
    serial = s["backward"] + s["update"]
    result.update(date=dt.date.today().isoformat(), repeats=args.repeats,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip(),
                  one_after_the_other=serial, saved_fraction=1 - s["both at once"] / serial)
    lines = [f"# Update beside the backward ({result['date']}, commit {result['commit']})", "",
             f"One tinyllama-1.1b decoder layer, batch 2, seq 1024, bf16 autocast; AdamW on "
             f"{result['updated_parameters']:,} fp32 parameters; {result['threads']} threads; "
             f"median of {args.repeats} rounds after a warm-up.", "",
             "| work | seconds |", "|---|---|",
             *[f"| {name} | {value:.3f} |" for name, value in s.items()],
             f"| backward, then update | {serial:.3f} |", "",
             f"Running the update beside the backward takes {s['both at once']:.3f} s against "
             f"{serial:.3f} s one after the other: "
             f"{abs(result['saved_fraction']) * 100:.0f}% "
             f"{'less' if result['saved_fraction'] >= 0 else 'more'}."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"update-overlap-{result['date']}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
