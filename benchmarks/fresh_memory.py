#!/usr/bin/env python3
"""What memory the process has to fault in costs the compute that touches it.

    ./run python benchmarks/fresh_memory.py [--model llama-134m] [--seq-len 1024]
        [--batch-size 4] [--passes 2] [--out FILE]

Two parts, in one process, malloc's thresholds as a budgeted step runs with
(``caching_allocator``):
- ``idle``: a fresh 256 MiB tensor filled after the process has been idle for 0 to 8 s
  since it freed the last one: the seconds of the fill and its GB/s. On a virtual machine
  whose balloon device reports free pages to the host, memory freed for a second or two is
  taken back, and faulting it in again runs at the host's pace, not the guest's.
- ``chain``: ``--model``'s decoder layers (random weights, fp32) run their taped forwards
  one after another, every tape kept, then their backwards in reverse order, ``--passes``
  times, as a step that keeps every tape does: per layer the forward's and the backward's
  seconds, the minor page faults they took and the RSS after the forward.
Writes ``--out`` (JSON) and prints it.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

from chain_sample import add_chain_arguments, random_chain
from tierflow.exec.memory import (caching_allocator,
                                  configure_host_allocator, rss_bytes)
from tierflow.exec.stage_call import backward_taped, forward_plain, forward_taped
from tierflow.profile.machine import cpu_model

FILL_BYTES = 256 << 20
PAUSES_S = (0, 0, 0.5, 1, 2, 4, 8, 0, 0)
MIB = 1 << 20


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def idle_fills() -> list[dict]:
    """A fresh tensor of FILL_BYTES filled after each pause of PAUSES_S, then freed."""
    rows = []
    for pause in PAUSES_S:
        time.sleep(pause)
        tensor = torch.empty(FILL_BYTES // 4, dtype=torch.float32)
        start = time.perf_counter()
        tensor.fill_(1.0)
        seconds = time.perf_counter() - start
        del tensor
        rows.append({"idle_s": pause, "fill_s": round(seconds, 4),
                     "gb_per_s": round(FILL_BYTES / seconds / 1e9, 2)})
    return rows


def chain_passes(model_name: str, seq_len: int, batch: int, passes: int) -> list[list[dict]]:
    """Per pass, per decoder layer: its taped forward and its backward, every tape kept
    until the backwards."""
    sample = random_chain(model_name, seq_len, batch)
    model, chain, ctx, autocast = sample.model, sample.chain, sample.ctx, sample.autocast
    x = sample.x
    x = forward_plain(chain.stages[0], x, ctx, autocast)  # the embedding: x[1]
    layers = range(1, len(chain.stages) - 1)  # between the embedding and the head
    out = []
    for _ in range(passes):
        rows, tapes, h = {i: {"layer": i} for i in layers}, [], x
        for i in layers:
            before, start = faults(), time.perf_counter()
            taped = forward_taped(chain.stages[i], h, ctx, autocast, input_grad=True)
            rows[i].update(fwd_s=round(time.perf_counter() - start, 3),
                           fwd_faults=faults() - before, rss_mib=rss_bytes() // MIB)
            tapes.append((i, taped))
            h = taped.y.detach()
        grad = torch.ones_like(h)  # x[n]: (batch, seq, hidden)
        for i, taped in reversed(tapes):
            before, start = faults(), time.perf_counter()
            grad = backward_taped(taped, grad)
            rows[i].update(bwd_s=round(time.perf_counter() - start, 3),
                           bwd_faults=faults() - before)
        del tapes, taped, grad
        for p in model.parameters():
            p.grad = None
        out.append([rows[i] for i in layers])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_chain_arguments(parser)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configure_host_allocator()
    with caching_allocator():
        idle = idle_fills()
        chain = chain_passes(args.model, args.seq_len, args.batch_size, args.passes)
    result = {"about": f"fresh memory: {FILL_BYTES // MIB} MiB filled after idle pauses; "
                       f"{args.model} seq {args.seq_len} batch {args.batch_size} fp32, its "
                       "decoder layers' taped forwards (every tape kept) and backwards, "
                       f"{args.passes} passes, malloc caching as budgeted steps run",
              "cpu": cpu_model(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "python": platform.python_version(),
              "idle": idle, "chain": chain}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
