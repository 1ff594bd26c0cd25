#!/usr/bin/env python3
"""`tierflow generate` streaming weights against accelerate's disk offload: tinyllama-1.1b, 1 GiB.

    .venv/bin/python benchmarks/generate_stream.py [--arch tinyllama-1.1b] [--ram 1GiB]
                                                   [--tokens 32] [--peers PATH]
                                                   [--cgroup 1.5GiB|none] [--tag TAG]
                                                   [--repeats 3]

In one run, each in a fresh process, on checkpoints of the same kind (`peers.py save`: bf16,
random weights) with a 16-token prompt, greedy:
- `--repeats` times (3), interleaved so that a change in the machine's load reaches all
  three, each reported as the median: the peer (`peers.py generate`: Hugging Face generate
  with accelerate's big-model offload under `max_memory={"cpu": RAM}`); `tierflow generate
  --ram RAM --temperature 0` (`tierflow.generate.sample.run`, what the command runs, called in the
  child so that it reports exact tok/s and RSS); the same on an int8 copy of the checkpoint
  that `tierflow quantize` writes first (lossy: how far its logits are from the bf16
  model's is measured in a fresh process with both in RAM);
- once each, for orientation: the peer with OMP_NUM_THREADS=1 (streaming tierflow computes
  with one thread fewer than the cores, leaving one to the reads); tierflow without `--ram`
  (every weight in RAM: what the compute allows); tierflow under `--ram` with a thread
  sampling, with mincore(2), how much of the checkpoint the page cache holds (apart, as the
  sampling slows the compute);
- with `--cgroup LIMIT` (1.5 GiB by default; root and cgroup v1 needed, else skipped with
  the reason), the peer and tierflow on both checkpoints once more, each inside a memory
  cgroup of that limit, which counts RSS and page cache together (`memory_cgroup.py`): the
  peer then holds to the terms tierflow's `--ram` sets itself.
All measure peak RSS above the RSS after importing torch and transformers' Llama classes.
Reports tok/s (prefill included), the ratios, the load average, what streaming printed and
the disk bound. Writes benchmarks/results/generate-stream-<date>[-TAG].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from generate_stream_report import disk_bound, report
from memory_cgroup import MemoryCgroup, memory_cgroup, unavailable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from tierflow.cli import measure  # noqa: E402
from tierflow.core.page_cache import drop_from_page_cache  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog near the river bank, and then it runs "
        "back home to sleep until the sun comes up again over the hills.")
PROMPT_TOKENS = 16

# The tierflow side, in a fresh process: the peer's baseline (RSS after importing torch and
# transformers' Llama classes), then what `tierflow generate` runs, then one JSON line.
CHILD = r"""
import ctypes, json, os, resource, sys, threading, time
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model_dir, prompt, tokens, ram = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ram = None if ram == "none" else ram
sampling = sys.argv[5] == "sample"  # the page cache, in a run of its own (it slows the compute)
path = os.path.join(model_dir, "model.safetensors")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
fd = os.open(path, os.O_RDONLY)
addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: never touched, no RSS
vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
cached = {"peak": 0, "stop": False}

def sample():  # the checkpoint's pages in the page cache, every 50 ms
    while not cached["stop"]:
        libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        cached["peak"] = max(cached["peak"], resident * page)
        time.sleep(0.05)

if sampling:
    threading.Thread(target=sample, daemon=True).start()
from tierflow.generate.options import GenerateRequest
from tierflow.generate.sample import run
start = time.perf_counter()
stats = run(GenerateRequest.of(model_dir, prompt, max_new_tokens=tokens, temperature=0,
                               dtype="bf16", ram=ram))
total = time.perf_counter() - start
cached["stop"] = True
print(json.dumps({"tok_s": round(stats.tok_s, 3), "new_tokens": stats.new_tokens,
                  "prompt_tokens": stats.prompt_tokens, "prefill_s": round(stats.prefill_s, 2),
                  "decode_s": round(stats.decode_s, 2), "wall_s": round(total, 1),
                  "baseline_rss_gib": round(base / 2**30, 3),
                  "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                        / 2**20, 3),
                  "page_cache_peak_mib": round(cached["peak"] / 2**20, 1) if sampling else None}),
      flush=True)
"""

# The peer, in a fresh process, on the checkpoint saved already (hard links, not its own
# ``save`` child, which builds the model whole and would not fit a cgroup's limit): what
# ``peers.py generate`` measures, with nothing changed but where the checkpoint comes from.
PEER_CHILD = r"""
import argparse, importlib.util, json, os, sys
peers_path, saved, arch, ram, tokens = sys.argv[1:6]
spec = importlib.util.spec_from_file_location("peers", peers_path)
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)

class Saved:
    returncode = 0

def link_saved(cmd, **kwargs):
    out = cmd[cmd.index("--out") + 1]
    os.makedirs(out)
    for name in os.listdir(saved):
        os.link(os.path.join(saved, name), os.path.join(out, name))
    return Saved()

peers.subprocess.run = link_saved
args = argparse.Namespace(arch=arch, ram=ram, tokens=int(tokens))
print(json.dumps(peers.generate(args)), flush=True)
"""


# How far the int8 copy's logits are from the bf16 model's, teacher-forced on the prompt and
# the bf16 model's greedy continuation; both in RAM, in a fresh process.
FIDELITY_CHILD = r"""
import json, sys
import torch
from tierflow import load_model
from tierflow.data.tokenizer import load_tokenizer
from tierflow.generate.options import Sampling
from tierflow.generate.sample import sample_ids
original, int8, prompt, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = load_tokenizer(original + "/tokenizer.json")
prompt_ids = tok.encode(prompt).ids
bf16 = load_model(original, dtype=torch.bfloat16)
ids = prompt_ids + list(sample_ids(bf16, prompt_ids, Sampling(tokens, temperature=0)))
with torch.inference_mode():
    reference = bf16(input_ids=torch.tensor([ids])).logits[0].float()  # (positions, vocab)
    del bf16
    quantized = load_model(int8, dtype=torch.bfloat16, for_generation=True).eval()
    logits = quantized(input_ids=torch.tensor([ids])).logits[0].float()
error = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).median()
same = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
print(json.dumps({"positions": len(ids), "logits_relative_error_median": round(float(error), 4),
                  "top1_agreement": round(float(same), 3)}), flush=True)
"""


def quantized_copy(model: Path, out: Path) -> str:
    """``tierflow quantize`` in a fresh process; what it printed, then the copy is synced and
    out of the page cache (as the checkpoint is)."""
    proc = subprocess.run([sys.executable, "-m", "tierflow", "quantize", "--model", str(model),
                           "--out", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    if proc.returncode != 0:
        raise SystemExit(f"tierflow quantize failed:\n{proc.stderr[-3000:]}")
    out_of_page_cache(out / "model.safetensors")
    return proc.stderr.strip().splitlines()[-1]


def fidelity(model: Path, int8: Path, prompt: str, tokens: int) -> dict:
    return measure.run_json([sys.executable, "-c", FIDELITY_CHILD, str(model), str(int8),
                             prompt, str(tokens)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def out_of_page_cache(path: Path) -> None:
    """Written back, then out of the page cache: a read of it then comes from the disk (and
    a cgroup's child cannot read pages charged to another cgroup without its limit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_from_page_cache(fd)
    finally:
        os.close(fd)


def checkpoint(peers: Path, arch: str, directory: Path) -> str:
    """``peers.py save`` (bf16, random weights) plus a tokenizer.json, synced to disk; returns
    a prompt of PROMPT_TOKENS tokens."""
    from tierflow.data.tokenizer import train_tokenizer
    subprocess.run([sys.executable, str(peers), "save", "--arch", arch, "--out", str(directory)],
                   check=True, capture_output=True)
    tok = train_tokenizer([TEXT * 4, "def add(a, b):\n    return a + b\n" * 4], 300)
    tok.save(str(directory / "tokenizer.json"))
    out_of_page_cache(directory / "model.safetensors")  # the sampler sees tierflow's reads
    return tok.decode(tok.encode(TEXT).ids[:PROMPT_TOKENS])


def run_tierflow(model: Path, prompt: str, tokens: int, ram: str | None, *,
                 sample_page_cache: bool = False,
                 cgroup: MemoryCgroup | None = None) -> tuple[dict, list[str]]:
    """``tierflow generate`` in a fresh process (``ram=None``: no budget, every weight in RAM):
    its JSON line and what it printed about streaming and speed. ``sample_page_cache``: a
    thread samples the checkpoint's pages in the page cache every 50 ms; its mincore calls
    over the whole file slow the compute (every weight in RAM: 4.7 and 5.4 tok/s with it, 9.6
    without), so the speed comes from a run without it. ``cgroup``: run inside it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-c", CHILD, str(model), prompt, str(tokens), ram or "none",
           "sample" if sample_page_cache else "time"]
    proc = subprocess.run(cgroup.command(cmd) if cgroup else cmd, capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"tierflow generate failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    printed = [line for line in proc.stderr.splitlines() if line.startswith("[stream]")]
    printed += [line for line in proc.stdout.splitlines() if line.startswith("[generate]")]
    return result, printed


def under_cgroup(args: argparse.Namespace, model: Path, int8: Path, prompt: str) -> dict:
    """The peer and tierflow (on the checkpoint and on its int8 copy) again, each under a
    memory cgroup of ``args.cgroup``: the same limit on RSS and page cache together for all
    (``memory_cgroup``). Returns each run with the cgroup's peak and how often the limit was
    reached, or why it was skipped."""
    why = "--cgroup none" if args.cgroup == "none" else unavailable()
    if why is not None:
        return {"skipped": why}
    from tierflow.core.units import parse_bytes
    runs: dict = {"limit": args.cgroup}
    with memory_cgroup(parse_bytes(args.cgroup)) as cgroup:
        for name in ("peer", "tierflow", "tierflow_int8"):
            out_of_page_cache(model / "model.safetensors")
            out_of_page_cache(int8 / "model.safetensors")
            cgroup.reset()
            try:
                if name == "peer":
                    run = measure.run_json(cgroup.command(
                        [sys.executable, "-c", PEER_CHILD, str(args.peers), str(model),
                         args.arch, args.ram, str(args.tokens)]))
                else:
                    run, _ = run_tierflow(int8 if name == "tierflow_int8" else model, prompt,
                                          args.tokens, args.ram, cgroup=cgroup)
            except (measure.ChildError, SystemExit) as e:  # killed at the limit, say
                run = {"failed": str(e).strip().splitlines()[0]}
            runs[name] = {**run, "cgroup_peak_gib": round(cgroup.peak_bytes() / 2**30, 3),
                          "limit_hits": cgroup.limit_hits()}
    return runs


def median_run(runs: list[tuple[dict, list[str]]]) -> tuple[dict, list[str]]:
    """The (result, printed) of the run with the median tok/s (the lower middle of an even
    count), the result with every run's tok/s in the order they ran."""
    ordered = sorted(runs, key=lambda run: run[0]["tok_s"])
    result, printed = ordered[(len(ordered) - 1) // 2]
    return {**result, "tok_s_runs": [run[0]["tok_s"] for run in runs]}, printed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="tinyllama-1.1b")
    p.add_argument("--ram", default="1GiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers" / "peers.py")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--tag", default="", help="added to the result files' names, to keep "
                   "another run of the same day")
    p.add_argument("--cgroup", default="1.5GiB",
                   help="also run both sides under a memory cgroup of this limit (RSS and page "
                        "cache together; needs root and cgroup v1), or none")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of the peer and of tierflow on each checkpoint, interleaved; "
                        "the report gives their medians")
    args = p.parse_args()
    load_before = os.getloadavg()
    peer_cmd = [sys.executable, str(args.peers), "generate", "--arch", args.arch, "--ram",
                args.ram, "--tokens", str(args.tokens)]
    peer1 = measure.run_json(peer_cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with tempfile.TemporaryDirectory() as tmp:
        model, int8 = Path(tmp) / "model", Path(tmp) / "int8"
        prompt = checkpoint(args.peers, args.arch, model)
        quantized = quantized_copy(model, int8)
        peers, bf16, int8_runs = [], [], []
        for _ in range(args.repeats):  # interleaved: a change in the machine's load hits all
            peers.append((measure.run_json(peer_cmd), []))
            bf16.append(run_tierflow(model, prompt, args.tokens, args.ram))
            int8_runs.append(run_tierflow(int8, prompt, args.tokens, args.ram))
        (peer, _), (ours, printed), (ours8, printed8) = map(median_run, (peers, bf16, int8_runs))
        cache, _ = run_tierflow(model, prompt, args.tokens, args.ram, sample_page_cache=True)
        ours["page_cache_peak_mib"] = cache["page_cache_peak_mib"]
        ours["tok_s_while_sampling"] = cache["tok_s"]
        in_ram, _ = run_tierflow(model, prompt, args.tokens, None)
        close = fidelity(model, int8, prompt, args.tokens)
        contained = under_cgroup(args, model, int8, prompt)
    date = dt.date.today().isoformat()
    stamp = date + (f"-{args.tag}" if args.tag else "")
    result = {"date": date, "arch": args.arch, "ram": args.ram, "tokens": args.tokens,
              "peer": peer, "peer_1_thread": peer1, "tierflow": ours,
              "tierflow_in_ram": in_ram, "tierflow_int8": ours8, "quantized": quantized,
              "fidelity": close, "printed_int8": printed8, "bound_int8": disk_bound(printed8),
              "cgroup": contained, "ratio": round(ours["tok_s"] / peer["tok_s"], 3),
              "ratio_int8": round(ours8["tok_s"] / peer["tok_s"], 3),
              "ratio_1_thread": round(ours["tok_s"] / peer1["tok_s"], 3),
              "bound": disk_bound(printed), "printed": printed, "load_before": load_before,
              "load_after": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"generate-stream-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (args.out / f"generate-stream-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
