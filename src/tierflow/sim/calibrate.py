"""The ``cpu`` hardware profile: this machine's matmul, memcpy and disk rates, measured once.

The matmul peaks are the trainer's own speed-of-light figures (``train/sol.py``: the best of
2048x2048 matmuls per dtype at the current thread count), so a predicted MFU and the
trainer's printed SOL % share one denominator. The fractions of those peaks that a training
step reaches (matmuls, attention, element-wise work) come from one eager decoder layer run
here (``layer_probe.py``). The profile is cached as
``hardware-cpu.json`` beside sol's ``calibration.json`` in the user's cache directory,
keyed by CPU model, thread count, torch version and what the measurement measures (a
profile measured by an older tierflow is measured again); ``tierflow calibrate`` measures
it again.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from ..measure import default_matmul_dtype
from ..train.sol import _cache_dir, cpu_identity, cpu_model, peak_matmul_flops
from .hardware import Hardware
from .layer_probe import measure_layer_rates, timed
from .precision import OPTIM_DTYPES

_VERSION = 6  # of what is measured: 2 times the disk past the page cache (exec/file_io.py),
# 3 adds the attention kernels' and the trainer's AdamW rates, 4 takes the matmul, attention
# and element-wise fractions from an eager decoder layer, 5 AdamW with each moment dtype,
# 6 runs that layer in fp32 where the CPU has no native bf16 (as the trainer then does)
_OPTIMIZER_PARAMS = 1 << 23  # elements of the parameter the AdamW probe updates
_COPY_BYTES = 256 << 20
_DISK_BYTES = 128 << 20


def _key() -> str:
    import torch
    return (f"{cpu_identity()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|v{_VERSION}")


def _cache_file() -> Path:
    return _cache_dir() / "hardware-cpu.json"


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
    return calibrate()


def calibrate(disk_dir: str | Path | None = None) -> Hardware:
    """Measure this machine and cache the profile. ``disk_dir``: where to time the disk
    (default: the cache directory)."""
    directory = Path(disk_dir) if disk_dir is not None else _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    flops = {dtype: peak_matmul_flops(dtype) for dtype in ("fp32", "bf16")}
    read, write = disk_bandwidth(directory)
    copy = memcpy_bandwidth()
    matmuls = default_matmul_dtype()  # the layer runs as the trainer's default does
    layer = measure_layer_rates(matmuls, flops[matmuls], copy)
    rates = {moments: optimizer_bandwidth(moments=moments) for moments in OPTIM_DTYPES}
    optimizer = rates["fp32"]
    profile = Hardware(
        name="cpu", about=f"measured on this machine: {cpu_model()}, {_threads()} threads",
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
    with contextlib.suppress(OSError):
        cache = _cache_file()
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": _key(), "profile": json.loads(profile.to_json())},
                                  indent=1))
        os.replace(tmp, cache)
    return profile


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def memcpy_bandwidth(nbytes: int = _COPY_BYTES) -> float:
    """Bytes copied per second by ``Tensor.copy_`` of ``nbytes``: the median of five (what
    a step's copies see, not the luckiest run)."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return nbytes / statistics.median(timed(lambda: dst.copy_(src)) for _ in range(5))


def optimizer_bandwidth(n: int = _OPTIMIZER_PARAMS, moments: str = "fp32") -> float:
    """Bytes per second of the trainer's AdamW (fp32 weights, ``moments`` moments) in the
    planner's traffic model (``Precision.update_traffic`` bytes per parameter and step). The
    median of five steps of one ``n``-element parameter. Low-precision moments move fewer
    bytes but convert them on every step, so their rate is measured, not scaled."""
    import torch

    from ..precision.adamw import AdamW
    from .precision import RunPrecision
    weight = torch.nn.Parameter(torch.zeros(n))
    weight.grad = torch.full((n,), 1e-3)
    optimizer = AdamW([weight], lr=1e-4, moment_dtype=moments)
    optimizer.step()  # creates the moments
    seconds = statistics.median(timed(optimizer.step) for _ in range(5))
    traffic = RunPrecision("fp32", "none", moments, "bf16").bytes_per_param().update_traffic
    return traffic * n / seconds


def disk_bandwidth(directory: Path, nbytes: int = _DISK_BYTES) -> tuple[float, float]:
    """(read, write) bytes/s of a synced write and an uncached read of ``nbytes`` in
    ``directory``, through the disk tier's own store (``exec/disk.py``)."""
    import torch

    from ..exec.disk import DiskStore
    with tempfile.TemporaryDirectory(dir=directory, prefix="tierflow-disk-probe-") as tmp:
        store = DiskStore(tmp)
        probe = torch.ones(nbytes // 4, dtype=torch.float32)
        write = timed(lambda: store.write("probe", [probe]))
        read = timed(lambda: store.read("probe", [probe]))
    return nbytes / read, nbytes / write
