"""One tinyllama-1.1b decoder layer (hidden 2048, MLP 5632, 32 heads, 4 KV heads; batch 2,
seq 1024, bf16 autocast) timed through the three passes a checkpointed training step runs
per layer: the forward without grad, the forward with grad and the backward. Shared by the
benchmarks that ask what slows that compute down, with the command line of those that
measure one row per mode, each in a fresh process. Not a benchmark itself."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def time_layer_passes(repeats: int) -> dict:
    """Median seconds of each pass over the repeats after the first (a warm-up)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tierflow.models.presets import preset_config

    config = preset_config("tinyllama-1.1b")
    config._attn_implementation = "sdpa"
    layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    x = torch.randn(2, 1024, config.hidden_size, requires_grad=True)  # (batch, seq, hidden)
    positions = torch.arange(1024)[None].expand(2, -1)  # (batch, seq)
    times = []
    for _ in range(repeats):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            embeddings = rope(x, positions)
            t0 = time.perf_counter()
            with torch.no_grad():
                layer(x, position_embeddings=embeddings)
            t1 = time.perf_counter()
            out = layer(x, position_embeddings=embeddings)
            out = out[0] if isinstance(out, tuple) else out  # (batch, seq, hidden)
            t2 = time.perf_counter()
        out.float().sum().backward()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    steady = times[1:]
    return {"forward_s": statistics.median(t[0] for t in steady),
            "forward_grad_s": statistics.median(t[1] for t in steady),
            "backward_s": statistics.median(t[2] for t in steady),
            "threads": torch.get_num_threads()}


def all_passes(row: dict) -> float:
    return row["forward_s"] + row["forward_grad_s"] + row["backward_s"]


def in_fresh_processes(script: str, modes: Sequence[str], args: Sequence[str]) -> list[dict]:
    """``script --child MODE *args`` once per mode, each a fresh process whose last line of
    output is its row (JSON)."""
    rows = []
    for mode in modes:
        cmd = [sys.executable, script, "--child", mode, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def rows_in_a_directory(script: str, modes: Sequence[str],
                        measure: Callable[[str, Path, int], dict], repeats: int,
                        about_dir: str) -> tuple[list[dict], int] | None:
    """The command line of a benchmark that measures one row per mode in a file directory:
    ``--dir`` (``about_dir``: what goes there; default a temporary directory), ``--repeats``
    (default ``repeats``) and the hidden ``--child MODE``, the fresh process that prints
    ``measure(MODE, directory, repeats)``. Returns (the rows, the repeats) in the parent,
    None in a child."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split(
        "\n\n")[0])
    parser.add_argument("--dir", default=None, help=f"where {about_dir} (default: a "
                        "temporary directory)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, Path(args.dir), args.repeats)))
        return None
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = in_fresh_processes(script, modes, ["--dir", directory,
                                                  "--repeats", str(args.repeats)])
    return rows, args.repeats


def pass_table(title: str, script: str, condition: str, rows: list[dict], repeats: int,
               extra: tuple[str, Callable[[dict], str]] | None = None) -> list[str]:
    """A Markdown table of the rows' pass times, each against the first row's."""
    base = rows[0]
    heading = f" {extra[0]} |" if extra else ""
    lines = [f"# {title} ({dt.date.today().isoformat()})", "",
             "One tinyllama-1.1b decoder layer, batch 2, seq 1024, bf16 autocast, "
             f"{base['threads']} compute threads; medians of {repeats - 1} repeats; each row a "
             f"fresh process. `benchmarks/{Path(script).name}`.", "",
             f"| {condition} | forward s | forward with grad s | backward s | all three vs "
             f"{base['mode']} |{heading}", "|---|---|---|---|---|" + ("---|" if extra else "")]
    for r in rows:
        cell = f" {extra[1](r)} |" if extra else ""
        lines.append(f"| {r['mode']} | {r['forward_s']:.3f} | {r['forward_grad_s']:.3f} | "
                     f"{r['backward_s']:.3f} | {all_passes(r) / all_passes(base):.2f}x |{cell}")
    return lines


def save(name: str, lines: list[str], rows: list[dict]) -> None:
    """benchmarks/results/<name>-<date>.{md,json}, and the table on stdout."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{name}-{dt.date.today().isoformat()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
