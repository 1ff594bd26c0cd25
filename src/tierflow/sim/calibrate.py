"""The ``cpu`` hardware profile: this machine's matmul, memcpy and disk rates, measured once,
and ``hardware(name)``, which returns it or a published profile.

The figures come from the probes of ``profile/machine.py``. The matmul peaks are the
trainer's own speed-of-light figures (``peak_matmul_flops``: the best of 2048x2048 matmuls per
dtype at the current thread count), so a predicted MFU and the trainer's printed SOL % share
one denominator. The fractions of those peaks that a training step reaches (matmuls,
attention, element-wise work) come from one eager decoder layer run here
(``layer_rates.py``). The profile is cached as ``hardware-cpu.json`` beside the matmul peaks'
``calibration.json`` in the user's cache directory, keyed by CPU model, thread count, torch
version and what the measurement measures (a profile measured by an older tierflow is
measured again), and only when other processes left the CPUs quiet while it was measured;
``tierflow calibrate`` measures it again.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import TierflowError
from ..core.files import write_text_atomically
from ..precision.config import OPTIM_DTYPES
from ..profile.machine import (
    Quiet,
    cache_dir,
    cpu_identity,
    cpu_model,
    default_matmul_dtype,
    disk_bandwidth,
    memcpy_bandwidth,
    optimizer_bandwidth,
    peak_matmul_flops,
    torch_threads,
)
from .hardware import NAMES, PUBLISHED, Hardware
from .layer_rates import measure_layer_rates

_VERSION = 6  # of what is measured: 2 times the disk past the page cache (exec/file_io.py),
# 3 adds the attention kernels' and the trainer's AdamW rates, 4 takes the matmul, attention
# and element-wise fractions from an eager decoder layer, 5 AdamW with each moment dtype,
# 6 runs that layer in fp32 where the CPU has no native bf16 (as the trainer then does)


def hardware(name: str) -> Hardware:
    """The profile called ``name``: ``cpu`` (calibrated here, measured on first use) or a
    published one."""
    if name == "cpu":
        return cpu_profile()
    if name in PUBLISHED:
        return PUBLISHED[name]
    raise TierflowError(f"--hardware {name!r} is unknown: use one of {', '.join(NAMES)}")


def _key() -> str:
    import torch
    return f"{cpu_identity()}|threads={torch_threads()}|torch={torch.__version__}|v{_VERSION}"


def _cache_file() -> Path:
    return cache_dir() / "hardware-cpu.json"


def cached_profile() -> Hardware | None:
    """The cached cpu profile of this machine and thread count, or None."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(_cache_file().read_text())
        if data.get("key") == _key():
            return Hardware.from_json(json.dumps(data["profile"]))
    return None


def cpu_profile() -> Hardware:
    """The cached profile, or a new measurement (a few seconds, announced on stderr)."""
    cached = cached_profile()
    if cached is not None:
        return cached
    print("note: no calibration of this machine yet: measuring matmul, memcpy and disk rates "
          "(a few seconds; 'tierflow calibrate' redoes it)", file=sys.stderr, flush=True)
    return calibrate().profile


@dataclass(frozen=True)
class Calibration:
    """A measured cpu profile, and whether it was kept (``kept`` False: other processes kept
    the CPUs busy while it was measured, so it serves the command that measured it only)."""
    profile: Hardware
    kept: bool


def calibrate(disk_dir: str | Path | None = None) -> Calibration:
    """Measure this machine, and cache the profile when other processes left the CPUs quiet
    meanwhile (``profile/machine.Quiet``): one busy process on a 2-core machine halved the
    layer's matmul and element-wise rates and AdamW's, and every prediction of the cached
    profile would have been twice as slow. ``disk_dir``: where to time the disk (default:
    the cache directory)."""
    directory = Path(disk_dir) if disk_dir is not None else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with Quiet() as quiet:
        profile = _measure(directory)
    if not quiet.quiet:
        print("note: other processes kept the CPUs busy while this machine was measured: its "
              "rates serve this command only and are not kept; run 'tierflow calibrate' when "
              "the machine is quiet", file=sys.stderr, flush=True)
        return Calibration(profile, kept=False)
    with contextlib.suppress(OSError):
        write_text_atomically(_cache_file(), json.dumps(
            {"key": _key(), "profile": json.loads(profile.to_json())}, indent=1))
    return Calibration(profile, kept=True)


def _measure(directory: Path) -> Hardware:
    """The cpu profile of this machine, its disk timed in ``directory``."""
    flops = {dtype: peak_matmul_flops(dtype) for dtype in ("fp32", "bf16")}
    read, write = disk_bandwidth(directory)
    copy = memcpy_bandwidth()
    matmuls = default_matmul_dtype()  # the layer runs as the trainer's default does
    layer = measure_layer_rates(matmuls, flops[matmuls], copy)
    rates = {moments: optimizer_bandwidth(moments=moments) for moments in OPTIM_DTYPES}
    optimizer = rates["fp32"]
    profile = Hardware(
        name="cpu", about=f"measured on this machine: {cpu_model()}, {torch_threads()} threads",
        gpu_bytes=None, peak_flops=flops, memory_bw=copy, host_link_bw=None,
        host_memory_bw=optimizer, disk_read_bw=read, disk_write_bw=write,
        matmul_efficiency=layer.matmul_efficiency, memory_efficiency=layer.memory_efficiency,
        ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        attention_efficiency=layer.attention_efficiency, optimizer_bw=rates,
        notes=(f"matmuls at {layer.matmul_efficiency:.2f} of the square-matmul peak in an "
               f"eager decoder layer with {matmuls} matmuls (measured)",
               f"causal attention at {layer.attention_efficiency:.2f} of the {matmuls} peak "
               f"(measured)",
               f"element-wise work at {layer.memory_efficiency:.2f} of memcpy's bandwidth "
               f"(measured)",
               "AdamW at " + ", ".join(f"{rate / 1e9:.1f} GB/s ({moments} moments)"
                                       for moments, rate in rates.items())
               + " of modelled traffic (measured)",
               "no GPU: RAM is the compute tier, the disk the offload tier"))
    return profile
