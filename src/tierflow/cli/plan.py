"""``tierflow plan``: predict, without running anything, how a model trains on a hardware
profile under memory budgets (the work is ``tierflow.sim``'s, imported when the command runs,
so that the other commands start without it; ``sim/options.py`` holds the flags plan and
sweep share)."""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from .args import memory_bytes


def register(sub: Any) -> None:
    """Add ``tierflow plan`` to the subcommands ``sub``."""
    from ..sim.options import add_setup_arguments
    plan = sub.add_parser(
        "plan", help="predict a training run on some hardware: placement, peaks, tok/s",
        description="Predict, without running anything, how a model trains on a hardware "
                    "profile under memory budgets: where weights, gradients and optimizer "
                    "states live, what is recomputed or offloaded, the peak per tier, the step "
                    "time, tokens/s, MFU, the bottleneck and the smallest budgets that work. "
                    "Exit code 2 with one line when nothing fits.")
    add_setup_arguments(plan, lists=False)
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the predicted plan (or its JSON)."""
    from ..sim.freeze import selection_for
    from ..sim.options import base_setup, hardware_from_args, one_positive
    from ..sim.predict import predict
    from ..sim.report import plan_text
    from ..sim.shapes import load_shape
    gpu = memory_bytes(args.gpu, "--gpu") if args.gpu is not None else None
    ram = memory_bytes(args.ram, "--ram") if args.ram is not None else None
    shape = load_shape(args.model)
    hw = hardware_from_args(args, lists=False)
    seq = one_positive(args.seq_len, "--seq-len")
    setup = base_setup(args, hw, shape)
    selection = selection_for(args.model, args.freeze, args.train_only)
    prediction = predict(replace(setup, seq=seq, gpu=gpu, ram=ram, selection=selection))
    print(prediction.to_json() if args.json else plan_text(prediction, hw), flush=True)
    return 0
