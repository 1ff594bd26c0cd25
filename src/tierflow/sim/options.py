"""The flags ``tierflow plan`` and ``tierflow sweep`` share, and the Setup they describe.

Memory sizes are byte strings (``24GiB``, ``500MB``) or bare numbers of GiB (``24``), as
GPU memory is usually quoted. ``sweep`` takes comma-separated lists of them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..core.config import DEFAULT_CLIP
from ..core.errors import TierflowError
from ..core.units import parse_bytes, size_with_unit
from ..models.freeze import split_patterns
from ..precision.config import (
    MASTERS,
    MATMUL_DTYPES,
    MODEL_DTYPES,
    OPTIM_DTYPES,
    PrecisionConfig,
)
from ..profile.machine import disk_free_bytes
from .calibrate import hardware
from .hardware import NAMES, Hardware
from .setup import Setup, default_precision
from .shapes import ModelShape


def memory_size(text: str, flag: str) -> int:
    """Bytes of ``text`` (``units.size_with_unit``: a bare number is GiB); one-line error if
    bad."""
    try:
        return parse_bytes(size_with_unit(text, flag), what=flag)
    except ValueError as e:
        raise TierflowError(str(e)) from None


def positive_list(text: str, flag: str, *, example: str = "4096,16384") -> list[int]:
    """``4096,16384`` -> [4096, 16384]; one-line error for anything else."""
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise TierflowError(f"{flag} {text!r}: {part!r} is not a whole number; give e.g. "
                                f"{flag} {example}") from None
        if value < 1:
            raise TierflowError(f"{flag} {text!r}: {value} must be at least 1")
        values.append(value)
    return values


def one_positive(text: str, flag: str) -> int:
    """A single whole number of at least 1, where a list is not taken."""
    values = positive_list(text, flag, example="4")
    if len(values) != 1:
        raise TierflowError(f"{flag} {text!r}: give one value here, e.g. {flag} {values[0]} "
                            "(tierflow sweep takes lists of --model, --seq-len, --gpu and --ram)")
    return values[0]


def add_setup_arguments(parser: argparse.ArgumentParser, *, lists: bool) -> None:
    """The flags of one configuration (``lists``: model, seq len, gpu and ram take
    comma-separated lists, for sweep)."""
    many = " (comma-separated list)" if lists else ""
    parser.add_argument("--model", required=True, metavar="PRESET|DIR",
                        help=f"a preset (llama3-8b, qwen2.5-0.5b, ...) or a directory with "
                             f"config.json{many}")
    parser.add_argument("--hardware", default="cpu", choices=NAMES,
                        help="hardware profile (default cpu: this machine, calibrated)")
    parser.add_argument("--gpu", metavar="SIZE", default=None,
                        help=f"GPU memory budget, e.g. 24 (GiB) or 24GiB (default: the "
                             f"profile's){many}")
    parser.add_argument("--ram", metavar="SIZE", default=None,
                        help=f"host RAM budget (default: unlimited){many}")
    disk = parser.add_mutually_exclusive_group()
    disk.add_argument("--disk", type=Path, metavar="DIR", default=None,
                      help="a disk tier in DIR (its free space is the budget)")
    disk.add_argument("--disk-bw", type=float, metavar="GB/S", default=None,
                      help="a disk tier of unlimited size at this read and write rate, GB/s")
    parser.add_argument("--seq-len", required=True, metavar="N",
                        help=f"tokens per sequence{many}")
    parser.add_argument("--batch-size", default="1", metavar="N",
                        help="sequences per micro-batch (default 1)")
    parser.add_argument("--grad-accum", default="1", metavar="N",
                        help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--clip", type=float, default=DEFAULT_CLIP, metavar="F",
                        help="as tierflow train --clip: the global gradient norm clipped to F, "
                             "which moves the updates after the backward; 0: no clipping, "
                             f"updates inside it (default {DEFAULT_CLIP})")
    parser.add_argument("--model-dtype", choices=MODEL_DTYPES, default=None,
                        help="weights and gradients (default: bf16 on a GPU, fp32 on the cpu)")
    parser.add_argument("--master", choices=MASTERS, default=None,
                        help="fp32 master weights beside bf16 ones (default: fp32 on a GPU)")
    parser.add_argument("--optim-dtype", choices=OPTIM_DTYPES, default=None,
                        help="AdamW moments (default fp32)")
    parser.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=None,
                        help="matmul dtype (default bf16; on the cpu profile fp32 where its "
                             "bf16 matmuls are the slower, as the trainer does)")
    parser.add_argument("--freeze", metavar="GLOBS", default=None,
                        help="predict a partial fine-tune: freeze the parameters whose names "
                             "match one of these comma-separated globs, as tierflow train "
                             "--freeze does (no gradient, no optimizer state; the layers "
                             "before the first that trains run forward only)")
    parser.add_argument("--train-only", metavar="GLOBS", default=None,
                        help="predict a fine-tune of only the parameters these comma-separated "
                             "globs name, as tierflow train --train-only does"
                             + (" (every --model must have them)" if lists else ""))
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def precision_from_args(args: argparse.Namespace, hw: Hardware) -> PrecisionConfig:
    """The precision flags over ``hw``'s default (``predict.default_precision``)."""
    default = default_precision(hw)
    prec = PrecisionConfig(args.model_dtype or default.model_dtype,
                           args.master or default.master,
                           args.optim_dtype or default.optim_dtype,
                           args.matmul_dtype or default.matmul_dtype)
    hw.flops(prec.matmul_dtype)  # a one-line error when the hardware lacks the dtype
    return prec


def hardware_from_args(args: argparse.Namespace, *, lists: bool) -> Hardware:
    """The ``--hardware`` profile, after the flags that need no profile are checked (the
    cpu profile imports torch and may take seconds to measure on first use). ``lists``:
    --seq-len, --gpu and --ram may be comma-separated lists (sweep)."""
    if args.gpu is not None and args.hardware == "cpu":
        raise TierflowError(f"--gpu {args.gpu}: hardware cpu has no GPU (RAM is its compute "
                            f"tier): leave --gpu out or pick a GPU profile")
    (positive_list if lists else one_positive)(args.seq_len, "--seq-len")
    for flag, text in (("--gpu", args.gpu), ("--ram", args.ram)):
        if text is not None:
            for value in (text.split(",") if lists else [text]):
                memory_size(value, flag)
    _setup_flags(args)
    return hardware(args.hardware)


def _setup_flags(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(batch size, accumulation, the --disk directory's free bytes or None), the disk flags
    checked."""
    batch = one_positive(args.batch_size, "--batch-size")
    accum = one_positive(args.grad_accum, "--grad-accum")
    split_patterns("--freeze", args.freeze)
    split_patterns("--train-only", args.train_only)
    disk_budget = None
    if args.disk is not None:
        if not args.disk.is_dir():
            raise TierflowError(f"--disk {args.disk} is not a directory: create it or give "
                                f"another one")
        disk_budget = disk_free_bytes(args.disk)
    if not args.clip >= 0:
        raise TierflowError(f"--clip {args.clip} must be 0 (no clipping) or a positive norm, "
                            "e.g. 1.0")
    if args.disk_bw is not None and not args.disk_bw > 0:
        raise TierflowError(f"--disk-bw {args.disk_bw} must be a positive rate in GB/s, e.g. 7")
    return batch, accum, disk_budget


def base_setup(args: argparse.Namespace, hw: Hardware, shape: ModelShape) -> Setup:
    """The configuration the flags describe, for the first model and sequence length."""
    batch, accum, disk_budget = _setup_flags(args)
    return Setup(shape=shape, hardware=hw, seq=1, batch=batch, grad_accum=accum,
                 disk=args.disk is not None or args.disk_bw is not None,
                 disk_budget=disk_budget,
                 disk_bw=(args.disk_bw * 1e9,) * 2 if args.disk_bw is not None else None,
                 precision=precision_from_args(args, hw), clips=args.clip > 0)
