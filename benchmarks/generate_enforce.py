#!/usr/bin/env python3
"""`tierflow generate --ram 1GiB --enforce` against the peer (`peers.py generate --ram 1GiB`:
Hugging Face generate with accelerate's disk offload) held by a memory cgroup of the same
budget: tinyllama-1.1b at random init, each run a fresh process.

    ./run python benchmarks/generate_enforce.py [--arch tinyllama-1.1b] [--ram 1GiB]
        [--tokens 32] [--repeats 1] [--peer-limit above-baseline|SIZE] [--peers PATH]
        [--tag TAG] [--out DIR]

The checkpoint is `peers.py save` (bf16, random weights, seed 0) with a tokenizer.json, as
`generate_stream.py` makes it, out of the page cache before every run (so that each reads
it from the disk, and a cgroup cannot lean on pages charged elsewhere); a 16-token prompt,
greedy, `--tokens` new tokens, bf16. The runs alternate, peer then tierflow, `--repeats`
times:
- tierflow: `tierflow generate --ram RAM --enforce --temperature 0 --dtype bf16`, which
  enters a memory cgroup of RAM above its RSS after the imports (page cache counted, no
  swap) before its first weight read;
- the peer: what `peers.py generate --arch ARCH --ram RAM` runs (`generate_stream.py`'s
  `PEER_CHILD`: the same function, the checkpoint hard-linked instead of built whole by its
  `save` child, which no such cgroup would hold), inside a cgroup v1 memory cgroup
  (`memory_cgroup.py`; root needed). Such a cgroup counts the whole process from its start,
  imports included, so by default (`--peer-limit above-baseline`) its limit is RAM plus the
  RSS a fresh process holds after the peer's imports (torch and transformers' Llama
  classes), measured first: the terms `--enforce` sets tierflow. `--peer-limit SIZE` sets it
  outright (e.g. `1GiB`: the whole process in RAM, imports included).
Reported per run: tok/s (prefill included), whether it completed, was killed by the kernel
(SIGKILL: the cgroup's out-of-memory killer) or failed (its error line), the peak RSS of the
process and above its baseline (the RSS after importing torch and transformers), and the
limit it ran under; for the peer the cgroup's own peak (RSS and page cache) and how often it
reached the limit. Writes benchmarks/results/generate-enforce-<date>[-TAG].{json,md},
naming the machine and the commit. `--arch llama-20m --ram 128MiB` is a smoke test.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
from generate_stream import PEER_CHILD, checkpoint, out_of_page_cache  # noqa: E402
from harness import machine, source_commit, write_results  # noqa: E402
from memory_cgroup import MemoryCgroup, memory_cgroup, unavailable  # noqa: E402

from tierflow.core.units import format_bytes, parse_bytes  # noqa: E402

GIB = 2 ** 30
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))

# the peer's baseline: the RSS after its imports (peers.py's own, before it measures)
PEER_BASELINE = ("import resource, torch; from transformers import LlamaConfig, "
                 "LlamaForCausalLM; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss "
                 "* 1024)")

# `tierflow generate ARGS` in a fresh process, with its RSS after importing torch and
# transformers (the baseline it counts --ram from) and its peak, as one JSON line on stderr
TIERFLOW_CHILD = r"""
import json, sys
import torch
import transformers.modeling_utils
from tierflow.exec.memory import rss_bytes
from tierflow.profile.machine import maxrss_bytes
from tierflow.cli.main import main
base = rss_bytes()
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"baseline_rss_bytes": base, "peak_rss_bytes": maxrss_bytes()}),
      file=sys.stderr, flush=True)
sys.exit(code)
"""


def outcome(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """completed, killed (SIGKILL: the cgroup's out-of-memory killer) or failed (its last
    error line)."""
    if proc.returncode == 0:
        return {"status": "completed"}
    if proc.returncode == -9:
        return {"status": "killed"}
    error = next((x for x in proc.stderr.splitlines() if x.startswith("tierflow: error:")),
                 (proc.stderr.strip().splitlines() or ["?"])[-1])
    return {"status": "failed", "returncode": proc.returncode, "error": error[-500:]}


def run_tierflow(model: Path, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """`tierflow generate --ram RAM --enforce` in a fresh process."""
    cmd = [sys.executable, "-c", TIERFLOW_CHILD, "generate", "--model", str(model), "--prompt",
           prompt, "--max-new-tokens", str(args.tokens), "--temperature", "0", "--dtype",
           "bf16", "--ram", args.ram, "--enforce"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=args.timeout)
    row: dict[str, Any] = {"run": "tierflow", **outcome(proc)}
    cgroup = next((x for x in proc.stderr.splitlines() if x.startswith("[memory cgroup]")),
                  None)
    limit = re.search(r"memory\.(?:max|limit_in_bytes) ([\d.]+ [KMGT]?i?B)", cgroup or "")
    row.update(cgroup=cgroup, limit=limit[1] if limit else None)
    speed = re.search(r"\[generate\] (\d+) tokens in ([\d.]+) s: ([\d.]+) tok/s", proc.stdout)
    if speed and row["status"] == "completed":
        row.update(new_tokens=int(speed[1]), seconds=float(speed[2]), tok_s=float(speed[3]))
    rss = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith('{"baseline')]
    if rss:
        row.update(rss[-1])
        row["peak_above_baseline_bytes"] = rss[-1]["peak_rss_bytes"] - rss[-1]["baseline_rss_bytes"]
    row["stream"] = [x for x in proc.stderr.splitlines() if x.startswith("[stream]")]
    return row


def run_peer(model: Path, args: argparse.Namespace, cgroup: MemoryCgroup | None,
             limit: int | None) -> dict[str, Any]:
    """`peers.py generate` (its function, on the saved checkpoint) in a fresh process, inside
    ``cgroup`` when there is one."""
    cmd = [sys.executable, "-c", PEER_CHILD, str(args.peers), str(model), args.arch, args.ram,
           str(args.tokens)]
    if cgroup is not None:
        cgroup.reset()
        cmd = cgroup.command(cmd)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    row: dict[str, Any] = {"run": "peer", **outcome(proc),
                           "limit": format_bytes(limit) if limit else None}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if lines and row["status"] == "completed":
        peer = json.loads(lines[-1])
        row.update(tok_s=peer["tok_s"], peak_rss_bytes=int(peer["peak_rss_gib"] * GIB),
                   baseline_rss_bytes=int(peer["baseline_rss_gib"] * GIB),
                   peak_above_baseline_bytes=int((peer["peak_rss_gib"]
                                                  - peer["baseline_rss_gib"]) * GIB))
    if cgroup is not None:
        row.update(cgroup_peak_bytes=cgroup.peak_bytes(), limit_hits=cgroup.limit_hits())
    return row


def peer_limit(args: argparse.Namespace) -> tuple[int, int | None]:
    """The peer's cgroup limit in bytes, and the baseline added to --ram (None: given)."""
    if args.peer_limit != "above-baseline":
        return parse_bytes(args.peer_limit), None
    proc = subprocess.run([sys.executable, "-c", PEER_BASELINE], capture_output=True,
                          text=True, check=True)
    baseline = int(proc.stdout.strip().splitlines()[-1])
    return parse_bytes(args.ram) + baseline, baseline


def median_tok_s(runs: list[dict[str, Any]], name: str) -> float | None:
    done = [r["tok_s"] for r in runs if r["run"] == name and "tok_s" in r]
    return statistics.median(done) if done else None


def report(result: dict[str, Any]) -> str:
    peer, ours = result["peer_tok_s_median"], result["tierflow_tok_s_median"]
    ratio = round(ours / peer, 3) if peer and ours else "-"
    lines = [f"# `tierflow generate --enforce` against the peer in a cgroup: {result['arch']} "
             f"under --ram {result['ram']} ({result['date']}, {result['commit']})", "",
             f"machine: {json.dumps(result['machine'])}", "",
             f"{result['tokens']} new tokens after a 16-token prompt, greedy, bf16, each run "
             f"a fresh process, alternating; the peer's cgroup: {result['peer_cgroup']}. "
             "`benchmarks/generate_enforce.py`.", "",
             f"tok/s tierflow / peer: **{ratio}** (medians: tierflow {ours}, peer {peer})", "",
             "| # | run | status | tok/s | limit | peak RSS (above baseline) | cgroup peak "
             "(RSS + page cache) | limit hits |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"], 1):
        peak = (f"{format_bytes(r['peak_rss_bytes'])} "
                f"({format_bytes(r['peak_above_baseline_bytes'])})"
                if "peak_rss_bytes" in r else "-")
        status = r["status"] + (f": {r['error']}" if "error" in r else "")
        cgroup_peak = format_bytes(r["cgroup_peak_bytes"]) if "cgroup_peak_bytes" in r else "-"
        lines.append(f"| {i} | {r['run']} | {status} | {r.get('tok_s', '-')} | "
                     f"{r.get('limit') or '-'} | {peak} | {cgroup_peak} | "
                     f"{r.get('limit_hits', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="tinyllama-1.1b", help="a peers.py architecture")
    p.add_argument("--ram", default="1GiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--peer-limit", default="above-baseline",
                   help="the peer's cgroup limit: above-baseline (--ram plus the RSS after "
                        "the peer's imports) or a size")
    p.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers" / "peers.py")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    date = dt.date.today().isoformat()
    why = unavailable()
    limit, baseline = peer_limit(args)
    described = (f"none ({why}): the peer ran unconstrained" if why else
                 f"cgroup v1, limit {format_bytes(limit)}" + (
                     f" (--ram {args.ram} + the peer's post-import RSS "
                     f"{format_bytes(baseline)})" if baseline else " (--peer-limit)"))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        prompt = checkpoint(args.peers, args.arch, model)
        for i in range(args.repeats):  # alternating: a change in the machine's load hits both
            out_of_page_cache(model / "model.safetensors")
            if why:
                runs.append(run_peer(model, args, None, None))
            else:
                with memory_cgroup(limit) as cgroup:
                    runs.append(run_peer(model, args, cgroup, limit))
            out_of_page_cache(model / "model.safetensors")
            runs.append(run_tierflow(model, prompt, args))
            for r in runs[-2:]:
                print(f"{r['run']} #{i + 1}: {r['status']}, {r.get('tok_s', '-')} tok/s, "
                      f"limit {r.get('limit')}", flush=True)
    result = {"date": date, "commit": source_commit(ROOT), "machine": machine(),
              "arch": args.arch, "ram": args.ram, "tokens": args.tokens,
              "repeats": args.repeats, "peer_cgroup": described,
              "peer_limit_bytes": None if why else limit, "peer_baseline_bytes": baseline,
              "peer_tok_s_median": median_tok_s(runs, "peer"),
              "tierflow_tok_s_median": median_tok_s(runs, "tierflow"), "runs": runs}
    name = f"generate-enforce-{date}" + (f"-{args.tag}" if args.tag else "")
    text = report(result)
    md, js = write_results(args.out, name, text, result)
    print(text)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
