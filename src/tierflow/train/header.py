"""The sections a run prints before its first step: ``[Options]`` (every option, defaults
resolved), ``[System]`` (torch, threads, CPU, the device and its budgets, precision, the
measured peak matmul rate that SOL is relative to) and ``[Dataset]``; each also a JSON record.
``[Plan]`` follows from ``logger.plan_section`` once the step is planned."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.units import section
from ..profile.machine import cpu_model, fast_bf16, peak_matmul_flops

if TYPE_CHECKING:
    from .logger import Logger
    from .run import Run, Site


def print_header(logger: Logger, run: Run, site: Site, model: nn.Module) -> float:
    """Print and record the three sections of ``run`` training ``model`` on ``site``;
    returns the peak matmul FLOP/s (0 off the CPU)."""
    opts, precision, tier, data = run.opts, site.precision, site.tier, run.data
    total, tokens_per_step = run.schedule.total, run.schedule.tokens_per_step
    # [Options]
    matmul = precision.matmul_dtype
    shown = opts.as_dict()
    shown.update({"steps": total, "warmup": run.schedule.warmup,
                  "min_lr": run.schedule.min_lr, "dtype": _autocast_name(matmul),
                  "matmul_dtype": matmul, "out": str(run.out), "log": str(logger.path)})
    logger.print(section("Options", [(k.replace("_", "-"), "-" if v is None else v)
                                     for k, v in shown.items()]))
    logger.record("options", **shown)

    # [System]
    peak_dtype = "fp32" if matmul == "fp32" else "bf16"  # fp8 is held to bf16's peak here
    on_cpu = tier.device.type == "cpu"
    peak = peak_matmul_flops(peak_dtype) if on_cpu else 0.0  # SOL is measured on CPUs only
    system = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
              "bf16 native": fast_bf16(), "device": tier.describe(),
              "dtype": _autocast_name(matmul),
              "precision": _precision_words(precision, on_cpu),
              "peak matmul": f"{peak / 1e9:.1f} GFLOP/s ({peak_dtype}, measured)" if on_cpu
              else "- (measured on CPUs only: no SOL on the GPU)"}
    if site.world is not None:
        system["ranks"] = (f"{site.world.size} ({site.world.backend}); this machine's figures "
                           "are rank 0's")
    logger.print()
    logger.print(section("System", list(system.items())))
    logger.record("system", **system, peak_matmul_flops=peak,
                  rss_baseline_bytes=site.baseline)
    if on_cpu and peak_dtype == "bf16" and not fast_bf16():
        fp32 = peak_matmul_flops("fp32")
        logger.print(f"note: this CPU has no native bf16 (AVX512-BF16 or AMX): its bf16 "
                     f"matmuls ran at {peak / 1e9:.1f} GFLOP/s against {fp32 / 1e9:.1f} in fp32; "
                     f"--matmul-dtype fp32 with fp32 weights trains faster here")

    # [Dataset]
    eval_tokens = len(data.eval) if data.eval is not None else 0
    dataset = [("train", f"{len(data.train):,} tokens ({data.path / 'train.bin'})"),
               ("eval", f"{eval_tokens:,} tokens" + (f" ({data.path / 'eval.bin'})" if data.eval
                                                     is not None else " (no eval.bin)")),
               ("vocab", f"{data.vocab_size:,} (model {model.config.vocab_size:,})"),
               ("seq len", opts.seq_len),
               ("tokens per step", f"{tokens_per_step:,} ({opts.batch_size} x {opts.grad_accum} x "
                                   f"{opts.seq_len})"),
               ("epochs", f"{total * tokens_per_step / len(data.train):.2f} over {total} steps")]
    logger.print()
    logger.print(section("Dataset", dataset))
    logger.record("dataset", train_tokens=len(data.train), eval_tokens=eval_tokens,
                  vocab_size=data.vocab_size, seq_len=opts.seq_len,
                  tokens_per_step=tokens_per_step, steps=total)
    return peak


def _autocast_name(matmul: str) -> str:
    """What ``--dtype`` names for a matmul dtype: the autocast mode (fp8 runs inside bf16)."""
    return "fp32" if matmul == "fp32" else "bf16"


def _precision_words(precision, on_cpu: bool) -> str:
    """``weights bf16, master none (stochastic rounding), moments int8, matmuls fp8 (...)``."""
    master = {"fp32": "fp32", "none": "none (stochastic rounding)"}[precision.master]
    if precision.model_dtype == "fp32":
        master = "- (fp32 weights are their own)"
    matmul = precision.matmul_dtype
    if matmul == "fp8":
        how = "products of the fp8 operands summed in fp32 matmuls on this CPU" if on_cpu \
            else "torch._scaled_mm"
        matmul = f"fp8 e4m3 (gradients {precision.fp8_grad}; {how})"
    return (f"weights {precision.model_dtype}, master {master}, moments "
            f"{precision.optim_dtype}, matmuls {matmul}")
