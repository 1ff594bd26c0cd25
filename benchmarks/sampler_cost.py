#!/usr/bin/env python3
"""What the host meter's RSS sampler costs the rounds it runs beside: one stage's profile
rounds timed with a sampling meter and with one that does not sample, alternately.

    ./run python benchmarks/sampler_cost.py [--model llama-134m] [--seq-len 1024]
        [--batch-size 4] [--pairs 8] [--stage 1] [--out FILE]

Cuts ``--model`` (random weights, vocabulary 32000, fp32) into its chain and runs the
profiler's round (``measure_round``: a forward without a tape, one with, the backward) of
stage ``--stage`` ``--pairs`` times each way, inside the caching allocator and its RSS guard
as a budgeted profile times its rounds, the order of the two switched every pair. Prints
and writes (``--out``, JSON) each way's forward and backward seconds, their medians and the
ratios sampled / unsampled, and how many pairs had the sampled round slower.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from chain_sample import add_chain_arguments, random_chain
from tierflow.exec.memory import (HostMeter, caching_allocator,
                                  configure_host_allocator)
from tierflow.exec.stage_call import context_tensors, forward_plain, storage_key
from tierflow.profile.machine import cpu_model
from tierflow.profile.profiler import StageRun, measure_round

GUARD_LEVEL = 64 << 30  # far above any RSS here: the guard looks every millisecond, never trims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_chain_arguments(parser)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configure_host_allocator()
    sample = random_chain(args.model, args.seq_len, args.batch_size)
    chain, x, ctx, autocast = sample.chain, sample.x, sample.ctx, sample.autocast
    for stage in chain.stages[:args.stage]:
        x = forward_plain(stage, x, ctx, autocast)
    held = {storage_key(p) for stage in chain.stages for p in stage.parameters()}
    held |= {storage_key(t) for t in context_tensors(ctx)}
    run = StageRun(chain.stages[args.stage], x, ctx, autocast, held, input_grad=True)
    meters = {"sampled": HostMeter(), "unsampled": HostMeter(interval=None)}
    times: dict[str, dict[str, list[float]]] = {k: {"fwd": [], "bwd": []} for k in meters}
    with caching_allocator(GUARD_LEVEL):
        measure_round(run, meters["unsampled"], None)  # warm-up
        for pair in range(args.pairs):
            for way in sorted(meters, reverse=pair % 2 == 1):
                measured = measure_round(run, meters[way], None)
                times[way]["fwd"].append(round(measured.fwd_time, 4))
                times[way]["bwd"].append(round(measured.bwd_time, 4))
    medians = {way: {p: round(statistics.median(ts), 4) for p, ts in t.items()}
               for way, t in times.items()}
    result = {
        "about": f"{args.model} stage {chain.names[args.stage]}, seq {args.seq_len}, batch "
                 f"{args.batch_size}, fp32, profile rounds inside the caching allocator and "
                 "its 1 ms RSS guard, a sampling host meter (0.5 ms) against one without, "
                 "alternating",
        "cpu": cpu_model(), "cores": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "pairs": args.pairs, "seconds": times,
        "median_s": medians,
        "ratio_sampled_to_unsampled": {p: round(medians["sampled"][p] / medians["unsampled"][p], 3)
                                       for p in ("fwd", "bwd")},
        "pairs_sampled_slower": {p: sum(a > b for a, b in zip(times["sampled"][p],
                                                                times["unsampled"][p]))
                                 for p in ("fwd", "bwd")},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
