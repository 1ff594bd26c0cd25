#!/usr/bin/env python3
"""The prepared GPU check: one command for a lent CUDA machine that runs within a deadline
and writes one JSON file of everything it measured.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT [--deadline 420] [--peers DIR]

In order, each part in a fresh process and skipped (and named as skipped) once the deadline
is too near:
1. the machine: GPU name, torch and transformers versions, a bf16 8192^3 matmul's TFLOP/s
   (the peak that an MFU figure divides by), the rate of a Llama-3-8B layer's matmuls over
   8192 tokens, forward and backward (what the h100-sxm profile's matmul efficiency should
   be measured against) and page-locked host-to-GPU copy GB/s;
2. ``tests/test_cuda.py`` (the out-of-memory retry included), each test's outcome;
3. Llama-3-8B at random init, seq 8192, ``--gpu 24GiB --ram 60GiB``, full bf16, through
   ``tierflow train`` (``benchmarks/gpu_llama8b.py``: each split of 16 sequences per step in
   its own process), with its MFU against the matmul peak of part 1;
4. tinyllama-1.1b, seq 1024, at batch 8 and 32: ``benchmarks/gpu_stream.py`` (plain PyTorch
   with Hugging Face checkpointing beside tierflow streaming every layer from host RAM, with
   the update on the GPU and on the host), and ``peers.py train --mode hf-ckpt --device cuda``
   where ``--peers`` names the folder holding ``peers.py``.

Writes ``OUT/gpu-check.json`` (rewritten after each part, so a run cut short still leaves
what it measured) and every part's output to ``OUT/parts.log``. Commit the JSON under ``benchmarks/results/`` with
the device named; docs/benchmarks.md says how these figures were read.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, time, torch, transformers
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")
before_cuda = rss()
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(10):
    a @ b
torch.cuda.synchronize()
tflops = 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12
# a Llama-3-8B layer's matmuls over 8192 tokens, forward and both backward products
# (q, k, v, o, gate, up, down as (tokens, in, out)): the rate the 8B's plan divides by
layer = [(8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 1024), (8192, 4096, 4096),
         (8192, 4096, 14336), (8192, 4096, 14336), (8192, 14336, 4096)]
tensors = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(k, o, device="cuda", dtype=torch.bfloat16),
            torch.randn(m, o, device="cuda", dtype=torch.bfloat16)) for m, k, o in layer]
def products():
    for x, w, dy in tensors:
        x @ w; dy @ w.t(); x.t() @ dy
products(); torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(5):
    products()
torch.cuda.synchronize()
layer_tflops = 5 * sum(6 * m * k * o for m, k, o in layer) / (time.perf_counter() - start) / 1e12
# the host RAM the GPU runtime holds once used as a trainer uses it (context, cuBLAS, the
# attention kernels forward and backward): what a --ram budget below a GPU cannot plan with
q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
torch.cuda.synchronize()
runtime_host = rss() - before_cuda
del q
host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(2**30, dtype=torch.uint8, device="cuda")
dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(5):
    dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
h2d = 5 * 2**30 / (time.perf_counter() - start) / 1e9
start = time.perf_counter()
for _ in range(5):
    host.copy_(dev, non_blocking=True)
torch.cuda.synchronize()
d2h = 5 * 2**30 / (time.perf_counter() - start) / 1e9
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cuda": torch.version.cuda,
                  "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                  "bf16_matmul_tflops": round(tflops, 1),
                  "llama8b_layer_matmul_tflops": round(layer_tflops, 1),
                  "cuda_runtime_host_mib": round(runtime_host / 2**20),
                  "pinned_h2d_gb_s": round(h2d, 1),
                  "pinned_d2h_gb_s": round(d2h, 1), "cpu_count": __import__("os").cpu_count()}))
"""


class Check:
    """The JSON record, its deadline, and one runner of fresh processes."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out = out
        self.end = time.monotonic() + deadline_s
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
        self.record: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                             "commit": commit, "parts": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                    os.environ.get("PYTHONPATH", "")]))

    def left(self) -> float:
        return self.end - time.monotonic()

    def run(self, name: str, cmd: list[str], limit_s: float, need_s: float = 20.0,
            env: dict | None = None) -> subprocess.CompletedProcess | None:
        """Run ``cmd`` for at most ``limit_s`` (less if the deadline is nearer); its output
        goes to OUT/parts.log. None, and the part marked skipped, when under ``need_s`` is left."""
        limit = min(limit_s, self.left())
        if limit < need_s:
            self.record["parts"][name] = {"skipped": f"{self.left():.0f} s left of the deadline"}
            self.save()
            return None
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env or self.env, capture_output=True,
                                  text=True, timeout=limit)
        except subprocess.TimeoutExpired as stopped:
            text = (stopped.stdout or b"").decode() if isinstance(stopped.stdout, bytes) \
                else (stopped.stdout or "")
            self.log(name, text)
            self.record["parts"][name] = {"timed_out_after_s": round(limit)}
            self.save()
            return None
        self.log(name, proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        self.record["parts"][name] = {"rc": proc.returncode,
                                      "wall_s": round(time.monotonic() - start, 1)}
        return proc

    def log(self, name: str, text: str) -> None:
        """Append one part's output to OUT/parts.log (few files come back from a device)."""
        with open(self.out / "parts.log", "a") as log:
            log.write(f"\n===== {name} =====\n{text}\n")

    def save(self) -> None:
        (self.out / "gpu-check.json").write_text(json.dumps(self.record, indent=1) + "\n")


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test's outcome from pytest's JUnit XML: passed, failed, error, skipped."""
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        kind = next((child.tag for child in case if child.tag in
                     ("failure", "error", "skipped")), "passed")
        message = next((child.get("message", "") for child in case), "")
        outcomes[case.get("name")] = kind if kind == "passed" else f"{kind}: {message[:300]}"
    return outcomes


def llama8b(check: Check, splits: str, limit_s: float, disk: bool, trace: bool) -> None:
    """Part 3: the 8B runs, each split's MFU against the measured bf16 matmul peak; with a
    disk tier below host RAM, or (``disk`` False) the issue's command, which has none."""
    proc = check.run("llama8b", [sys.executable, "benchmarks/gpu_llama8b.py", "--work",
                                 "/tmp/gpu-llama8b", "--splits", splits, "--deadline",
                                 str(limit_s - 15),
                                 *([] if disk else ["--no-disk", "--disk-if-refused"]),
                                 *(["--trace", str(check.out)] if trace else [])],
                     limit_s, need_s=90)
    result = last_json(proc.stdout) if proc is not None and proc.returncode == 0 else None
    if result is None:
        return
    peak = (check.record.get("machine") or {}).get("bf16_matmul_tflops")
    for row in result["splits"]:
        if peak and row.get("flops_per_token") and row.get("tok_s"):
            row["mfu_of_measured_peak"] = round(row["flops_per_token"] * row["tok_s"]
                                                / (peak * 1e12), 3)
    check.record["llama8b"] = result
    check.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu-check.json and the logs")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds for everything")
    parser.add_argument("--peers", help="folder holding peers.py (../shared/peers copied in)")
    parser.add_argument("--batches", default="8,32", help="tinyllama's ('': none)")
    parser.add_argument("--configs", default="plain,stream,stream-host")
    parser.add_argument("--tests", default="tests/test_cuda.py", help="pytest's arguments")
    parser.add_argument("--commit", help="the commit the tree is (a device's copy of the "
                                         "tree may carry a stale .git)")
    parser.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    parser.add_argument("--llama8b-splits", default="4x4,8x2",
                        help="gpu_llama8b.py's --splits ('' skips the 8B part)")
    parser.add_argument("--llama8b-s", type=float, default=300.0, help="seconds for the 8B part")
    parser.add_argument("--llama8b-no-disk", action="store_true",
                        help="the 8B without a disk tier (the issue's command); with one if "
                             "the trainer refuses that")
    parser.add_argument("--trace", action="store_true",
                        help="a trace of each streamed configuration and 8B split in OUT, "
                             "its predicted timeline beside it, and busy seconds per resource "
                             "in the JSON")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.deadline)
    if args.commit:
        check.record["commit"] = args.commit

    proc = check.run("machine", [sys.executable, "-c", PROBE], 60)
    if proc is not None and proc.returncode == 0:
        check.record["machine"] = last_json(proc.stdout)
    check.save()

    if args.llama8b_splits:
        llama8b(check, args.llama8b_splits, args.llama8b_s, not args.llama8b_no_disk,
                args.trace)

    junit = out / "test-cuda.xml"
    proc = None if args.no_tests else check.run("test_cuda", [sys.executable, "-m", "pytest", *args.tests.split(), "-q",
                                   "-rfE", "-p", "no:cacheprovider", f"--junitxml={junit}"], 240)
    if proc is not None and junit.exists():
        outcomes = junit_outcomes(junit)
        check.record["test_cuda"] = {
            "passed": sum(v == "passed" for v in outcomes.values()),
            "not_passed": {k: v for k, v in outcomes.items() if v != "passed"},
            "summary": proc.stdout.strip().splitlines()[-1:]}
    check.save()

    stream_env = dict(check.env, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    for batch in (int(b) for b in args.batches.split(",") if b):
        gpu, ram = ("10GiB", "64GiB") if batch <= 8 else ("20GiB", "100GiB")
        rows = []
        for config in args.configs.split(","):
            proc = check.run(f"stream-b{batch}-{config}",
                             [sys.executable, "benchmarks/gpu_stream.py", "--one", config,
                              "--batch", str(batch), "--gpu", gpu, "--ram", ram, "--steps", "4",
                              *(["--trace", str(out)] if args.trace else [])],
                             120, need_s=40, env=stream_env)
            row = last_json(proc.stdout) if proc is not None and proc.returncode == 0 else None
            if row is not None:
                row.pop("explain", None)
                rows.append(row)
        check.record[f"stream_b{batch}"] = rows
        if args.peers:
            proc = check.run(f"peer-b{batch}",
                             [sys.executable, str(Path(args.peers) / "peers.py"), "train",
                              "--mode", "hf-ckpt", "--device", "cuda", "--arch", "tinyllama-1.1b",
                              "--seq", "1024", "--batch", str(batch), "--steps", "4"],
                             90, need_s=30)
            if proc is not None and proc.returncode == 0:
                check.record[f"peer_b{batch}"] = last_json(proc.stdout)
        check.save()
    check.record["finished_with_s_left"] = round(check.left())
    check.save()
    print(json.dumps(check.record, indent=1))


if __name__ == "__main__":
    main()
