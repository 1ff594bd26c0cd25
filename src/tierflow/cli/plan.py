"""``tierflow plan``: predict, without running anything, how a model trains on a hardware
profile under memory budgets (the work is ``tierflow.sim``'s, imported when the command runs,
so that the other commands start without it; ``sim/options.py`` holds the flags plan and
sweep share)."""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from ..core.errors import BudgetError, TierflowError
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
                    "When nothing fits: exit code 2 and one line naming the smallest budgets "
                    "and the cheapest changes that fit (precision, a disk tier, a shorter "
                    "sequence), each with its predicted tok/s.")
    add_setup_arguments(plan, lists=False)
    plan.add_argument("--measure", action="store_true",
                      help="plan on this machine's measurements instead of the calibrated "
                           "rates (--hardware cpu only): after a tierflow train run of the "
                           "same model, sequence, batch, precision and --ram here, on what "
                           "that run measured and kept (its plan, to the byte); else on the "
                           "model's stages measured now as the trainer measures them (a copy "
                           "with one decoder layer, random weights; minutes for a 1B model) "
                           "and, with --disk, the directory's bandwidth: the plan train "
                           "would make here")
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
    if args.measure:
        check_measurable(args)  # before the cpu profile is measured
    hw = hardware_from_args(args, lists=False)
    seq = one_positive(args.seq_len, "--seq-len")
    setup = base_setup(args, hw, shape)
    selection = selection_for(args.model, args.freeze, args.train_only)
    setup = replace(setup, seq=seq, gpu=gpu, ram=ram, selection=selection)
    if args.measure:
        setup = measured_setup(args, setup)
    try:
        prediction = predict(setup)
    except BudgetError as err:
        raise TierflowError(f"{err}; {changes_that_fit(setup)}") from None
    print(prediction.to_json() if args.json else plan_text(prediction, hw), flush=True)
    return 0


def check_measurable(args: argparse.Namespace) -> None:
    """Refuse ``--measure`` where it cannot measure: another machine's profile, or a partial
    fine-tune (its one-layer copy would not freeze what the globs name)."""
    if args.hardware != "cpu":
        raise TierflowError(f"--measure measures this machine: --hardware {args.hardware} "
                            "is a profile of another; give --hardware cpu or leave --measure "
                            "out")
    if args.freeze is not None or args.train_only is not None:
        raise TierflowError("--measure measures a model that trains whole: leave --freeze "
                            "and --train-only out, or --measure")


def measured_setup(args: argparse.Namespace, setup: Any) -> Any:
    """``setup`` planned on what ``tierflow train`` measured for this run here, where it
    kept that (``profile/kept_profiles.py``): its chain's costs, its optimizer's rates, its
    disk tier's rates and the bytes of --ram its process held outside the plan, so that
    the plan printed is the plan it ran. Else measured now (``sim/measured.py``) and, with
    ``--disk DIR``, that directory's read and write rates as the trainer measures them."""
    from ..profile.kept_profiles import RunShape, kept_profile
    from ..profile.machine import disk_tier_bandwidth
    from ..sim.measured import measure
    kept = kept_profile(RunShape(setup.shape.architecture(), setup.batch, setup.seq,
                                 setup.run_precision.to_dict(), setup.ram, setup.disk))
    if kept is not None:
        measured = kept.measured
        origin = f"tierflow train here on {kept.date} (kept in {kept.path})"
        disk_bw = measured.disk_rates if args.disk is not None and measured.disk_rates \
            else setup.disk_bw
        return replace(setup, measured=replace(measured, origin=origin), disk_bw=disk_bw)
    if args.disk is not None:
        setup = replace(setup, disk_bw=disk_tier_bandwidth(args.disk))
    return replace(setup, measured=measure(args.model, setup))


SHORTER_SEQUENCES = 3  # halvings of --seq-len tried when nothing fits


def _tok_s(setup: Any) -> float | None:
    """The predicted tok/s of ``setup``, or None where nothing fits (in a worker process)."""
    from ..sim.predict import predict
    try:
        return predict(setup, smallest_budgets=False).tokens_per_second
    except (BudgetError, TierflowError):
        return None


def changes_that_fit(setup: Any) -> str:
    """The cheapest changes to ``setup`` (a ``sim.setup.Setup`` that nothing fits) under
    which a plan fits, each with its predicted tok/s, in words: the precision that needs the
    fewest bytes short of int8 moments (``--master none --optim-dtype bf16``), a disk tier,
    both, and the longest shorter sequence (halvings) that fits. Each is one more search of
    the trainer's planner (``sim/tiered.py``), without the smallest budgets, the searches in
    parallel processes."""
    from ..precision.config import PrecisionConfig

    prec = setup.run_precision
    lean = PrecisionConfig("bf16", "none", "bf16", prec.matmul_dtype, prec.fp8_grad)
    lean_flags = " ".join(f"--{flag} {new}" for flag, old, new in (
        ("model-dtype", prec.model_dtype, "bf16"), ("master", prec.master, "none"),
        ("optim-dtype", prec.optim_dtype, "bf16")) if old != new)
    try:
        lean.validate()
    except TierflowError:
        lean_flags = ""
    options: list[tuple[str, Any]] = []
    if lean_flags and lean.bytes_per_parameter().total < prec.bytes_per_parameter().total:
        options.append((lean_flags, replace(setup, precision=lean)))
    if not setup.disk:
        options.append(("--disk DIR", replace(setup, disk=True)))
        if lean_flags:
            options.append((f"{lean_flags} --disk DIR", replace(setup, precision=lean,
                                                                 disk=True)))
    shorter = [setup.seq >> k for k in range(1, SHORTER_SEQUENCES + 1) if setup.seq >> k]
    options += [(f"--seq-len {seq}", replace(setup, seq=seq)) for seq in shorter]
    with ProcessPoolExecutor(max_workers=min(len(options), os.cpu_count() or 1)) as pool:
        rates = dict(zip((flags for flags, _ in options),
                         pool.map(_tok_s, (candidate for _, candidate in options))))
    fits = []
    for flags, _ in options:
        if flags.startswith("--seq-len"):
            continue
        if any(flags.startswith(done) or flags.endswith(done) for done, _ in fits):
            continue  # a cheaper change in it already fits
        if rates[flags] is not None:
            fits.append((flags, rates[flags]))
    fits += [(f"--seq-len {seq}", rates[f"--seq-len {seq}"]) for seq in shorter
             if rates[f"--seq-len {seq}"] is not None][:1]  # the longest that fits
    seq = shorter[-1] if shorter else setup.seq
    if not fits:
        return ("neither bf16 weights and moments without a master copy, a disk tier nor a "
                f"sequence down to {max(seq, 1)} tokens fits either")
    return "these fit: " + "; ".join(f"{flags} (PREDICTED {rate:,.0f} tok/s)"
                                     for flags, rate in fits)
