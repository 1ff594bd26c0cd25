"""Speed of light: this machine's peak matmul rate and the FLOPs a training step needs,
so that the trainer can print SOL % = achieved model FLOP/s over the peak."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def _cache_dir() -> Path:
    base = os.environ.get("TIERFLOW_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tierflow"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_matmul_flops(dtype_name: str) -> float:
    """This machine's peak matmul FLOP/s for ``dtype_name`` (fp32 or bf16) at the current
    thread count: the best of timed square matmuls, cached in calibration.json, unless other
    processes kept the CPUs busy while it was timed (a figure measured then would be too low
    for good)."""
    import torch
    key = (f"{cpu_identity()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
           f"|{dtype_name}")
    cache = _cache_dir() / "calibration.json"
    data: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(cache.read_text())
    entry = data.get("matmul", {}).get(key) if isinstance(data, dict) else None
    if isinstance(entry, (int, float)) and entry > 0:
        return float(entry)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    before = _cpu_seconds()
    a, b, one = _timed_operands(dtype)
    n = a.shape[0]
    best, spent = one, one
    for _ in range(20):
        if spent > 1.0:
            break
        t = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    flops = 2 * n ** 3 / best
    if _others_were_busy(before, _cpu_seconds()):
        return flops
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        data = data if isinstance(data, dict) else {}
        data.setdefault("matmul", {})[key] = flops
        tmp = cache.with_name(f".calibration.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, cache)
    return flops


_BUSY_SHARE = 0.25  # of the machine's CPU time, taken by other processes: too busy to cache


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall-clock seconds, CPU seconds all processes have spent busy since boot, this
    process's CPU seconds), or None where /proc/stat cannot be read (not Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...; a hypervisor's steal is busy too
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    own = os.times()
    return (time.perf_counter(), (user + nice + system + irq + softirq + steal)
            / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def _others_were_busy(before: tuple[float, float, float] | None,
                      after: tuple[float, float, float] | None) -> bool:
    """Whether other processes (not this one: a busy training process is no reason to
    measure again) took more than _BUSY_SHARE of the CPUs between ``before`` and ``after``
    (``_cpu_seconds``). Without /proc/stat: whether more threads were runnable than there are
    CPUs, by the load average (which counts this process too)."""
    cpus = os.cpu_count() or 1
    if before is None or after is None:
        return os.getloadavg()[0] > cpus
    wall, busy, own = (a - b for a, b in zip(after, before))
    return busy - own > _BUSY_SHARE * cpus * wall


_SIZES = (256, 512, 1024, 2048)  # the largest is the peak's reference size
_LONG_ENOUGH = 0.2  # seconds: a matmul this long is timed well; a larger one only costs time


def _timed_operands(dtype) -> tuple[Any, Any, float]:
    """(a, b, seconds of a @ b after a warm-up), n x n each: n the smallest of ``_SIZES`` whose
    matmul takes ``_LONG_ENOUGH``, or the largest. A CPU without native bf16 runs bf16
    matmuls through PyTorch's scalar fallback, hundreds of times slower than fp32 (a 2048
    matmul took 52 s on a 2-core AVX2 machine), so the size grows only while it is fast."""
    for n in _SIZES:
        a, b = _square_operands(n, dtype)
        a @ b  # warm-up: the kernel chosen, the output allocated
        start = time.perf_counter()
        a @ b
        seconds = time.perf_counter() - start
        if seconds >= _LONG_ENOUGH:
            break
    return a, b, seconds


def _square_operands(n: int, dtype):
    """Two n x n random matrices of ``dtype`` (the global RNG left as it was)."""
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)


def cpu_identity() -> str:
    """The CPU's model name and whether it computes bf16 natively: the key of measured
    figures (virtual machines may name different CPU generations alike, e.g. "AMD EPYC")."""
    from ..measure import fast_bf16
    return f"{cpu_model()}|bf16 {'native' if fast_bf16() else 'emulated'}"


def model_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of the parameters used in matmuls (the input embedding is a
    lookup; a tied head counts once, as the head) and of attention. Per matmul parameter: 2
    forward, 2 for the gradient of its input when anything before it trains, 2 for its own
    gradient when it trains. Attention, per layer: 4 x width x seq forward, 8 backward when
    the layer backpropagates. With every parameter trainable: 6 x parameters + 12 x layers x
    width x seq. Frozen parameters (``--freeze``) count what plain autograd computes."""
    from ..chain.hf import decoder_layers

    config = model.config
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = emb is not None and out is not None and out.weight is emb.weight
    lookup = emb.weight if emb is not None and not tied else None
    layers = decoder_layers(getattr(model, "base_model", model))[1]
    first_param_of_layer = {id(next(layer.parameters())): i for i, layer in enumerate(layers)}
    order = list({id(p): p for p in model.parameters()}.values())  # tied ones once
    if tied:  # computed last, as the head; its lookup feeds the first layer
        order = [p for p in order if p is not emb.weight] + [emb.weight]
    backprop = tied and emb.weight.requires_grad  # whether anything computed before trains
    total = 0.0
    layers_backprop = 0
    for p in order:
        if id(p) in first_param_of_layer and (backprop or any(
                q.requires_grad for q in layers[first_param_of_layer[id(p)]].parameters())):
            layers_backprop += 1
        backprop = backprop or p.requires_grad
        if p is lookup:
            continue
        total += p.numel() * (2 + 2 * backprop + 2 * p.requires_grad)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return total + (4.0 * len(layers) + 8.0 * layers_backprop) * width * seq_len
