#!/usr/bin/env python3
"""How the profiler's host transients vary between rounds: RSS sampling against the ledger.

    .venv/bin/python benchmarks/profile_transients.py [--rounds 8] [--model llama-20m]
                                                     [--seq-len 512] [--batch-size 4]

Cuts ``--model`` (random weights, vocabulary 32000) into its chain under the exact malloc
thresholds a RAM budget uses, and measures each stage ``--rounds`` times, as a profile round
does: the forward without a tape, the forward with one and the backward. Each round is
measured twice, once by the RSS meter alone (its sampling thread) and once by the tensor
ledger alone (``profile/tensor_ledger.py``). For each stage and each of the three transients
it prints the smallest and largest of the rounds in MiB: a wide RSS range is a peak the
sampler caught in some rounds only; the profiler takes the larger of the two per round.
"""
from __future__ import annotations

import argparse


from chain_sample import add_chain_arguments, random_chain
from tierflow.exec.memory import HostMeter, configure_host_allocator
from tierflow.exec.stage_call import forward_plain, storage_key
from tierflow.profile.profiler import StageRun, measure_round
from tierflow.profile.tensor_ledger import TensorLedger

MIB = 1 << 20
FIELDS = ("fwd_transient_nograd", "fwd_transient", "bwd_transient")


class _NoMeter(HostMeter):
    """A meter that sees nothing: the ledger's count alone."""

    def current(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    add_chain_arguments(parser, model="llama-20m", seq_len=512)
    args = parser.parse_args()
    configure_host_allocator()
    sample = random_chain(args.model, args.seq_len, args.batch_size)
    chain, x, ctx, autocast = sample.chain, sample.x, sample.ctx, sample.autocast
    held = {storage_key(p) for stage in chain.stages for p in stage.parameters()}
    rss, blind = HostMeter(), _NoMeter()
    print(f"{args.model} seq {args.seq_len} batch {args.batch_size}, {args.rounds} rounds "
          "per stage: min-max MiB over the rounds, RSS meter | tensor ledger")
    print(f"{'stage':10s}" + "".join(f"{f:>32s}" for f in FIELDS))
    for i, stage in enumerate(chain.stages):
        run = StageRun(stage, x, ctx, autocast, held, input_grad=x.is_floating_point() and i > 0)
        by_rss, by_ledger = [], []
        for _ in range(args.rounds + 1):  # the first is a warm-up
            by_rss.append(measure_round(run, rss, None))
            ledger = TensorLedger()
            with ledger:
                by_ledger.append(measure_round(run, blind, ledger))
        cells = []
        for field in FIELDS:
            a = [getattr(r, field) / MIB for r in by_rss[1:]]
            b = [getattr(r, field) / MIB for r in by_ledger[1:]]
            cells.append(f"{min(a):6.1f}-{max(a):6.1f} | {min(b):6.1f}-{max(b):6.1f}")
        print(f"{chain.names[i]:10s}" + "".join(f"{c:>32s}" for c in cells))
        if i + 1 < len(chain.stages):
            x = forward_plain(stage, x, ctx, autocast)


if __name__ == "__main__":
    main()
