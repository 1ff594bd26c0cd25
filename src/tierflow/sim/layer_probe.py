"""How fast eager PyTorch runs a decoder layer here: the rates ``stages.py`` prices layers at.

The analytic model splits a layer's time into matmuls (FLOPs at a fraction of the matmul
peak), causal attention (FLOPs at its own fraction) and element-wise work (the traffic
``layer_traffic`` counts, at a fraction of memcpy's bandwidth). Micro-benchmarks of each part
alone are too kind: in a real layer the matmuls read transposed operands and write fresh
outputs, and the element-wise work is many small eager kernels, dtype casts under autocast
and Python between them. So ``tierflow calibrate`` runs one Llama decoder layer of a probe
shape (not a shape the calibration table checks) forward and backward as the CPU trainer
does by default (under bf16 autocast where the CPU computes bf16 natively, else in fp32),
attributes its time with ``torch.profiler`` and returns the three fractions that make the
model's layer time equal the measured one.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields

from ..errors import TierflowError
from .shapes import ModelShape, shape_from_config
from .stages import StepShape, attention_flops, dense_flops, layer_traffic

# hidden 1024, 16 heads of 64, 4 KV heads, SwiGLU 2816
PROBE_CONFIG = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 1024,
                "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
                "vocab_size": 256, "max_position_embeddings": 1024}
# 4 sequences of 1024 tokens (1 in fp32: about a second a pass either way)
PROBE_STEPS = {"bf16": StepShape(seq=1024, batch=4), "fp32": StepShape(seq=1024, batch=1)}
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
_ATTENTION_MARK = "scaled_dot_product"  # flash attention's forward and backward kernels


@dataclass(frozen=True)
class LayerRates:
    """Fractions of the peaks that one eager decoder layer reaches on this machine."""

    matmul_efficiency: float  # of the matmul peak of the probe's dtype
    attention_efficiency: float  # of the same peak, causal attention fwd + bwd
    memory_efficiency: float  # of memcpy's bandwidth, for layer_traffic's element-wise bytes
    layer_seconds: float  # the probe layer's forward + backward, measured


def measure_layer_rates(matmuls: str, peak: float, memory_bw: float,
                        repeats: int = 5) -> LayerRates:
    """Time ``repeats`` forward + backward passes of the probe layer with ``matmuls`` ("bf16":
    under autocast; "fp32") whose matmul peak is ``peak`` FLOP/s, after a warm-up, split
    each one's time by what the profiler attributes to matmuls and attention (the rest is
    element-wise work and the Python between kernels), express each part as a fraction of
    its peak and take the median of each fraction (the element-wise part is a difference of
    timings: one slow repeat would swing it)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in PROBE_CONFIG.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    shape = shape_from_config(PROBE_CONFIG, "probe")
    step = PROBE_STEPS[matmuls]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
        x = torch.randn(step.batch, step.seq, shape.hidden, requires_grad=True)  # (b, s, h)
    positions = torch.arange(step.seq)[None].expand(step.batch, -1)  # (b, s)

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=matmuls == "bf16"):
            out = layer(x, position_embeddings=rope(x, positions))
            out = out[0] if isinstance(out, tuple) else out  # (b, s, h)
        out.float().sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(2):  # warm-up: kernels chosen, malloc's caches filled
        forward_backward()
    splits = [_profiled(forward_backward) for _ in range(repeats)]
    regime = "autocast" if matmuls == "bf16" else "fp32"
    rates = [_rates(shape, step, regime, peak, memory_bw, *split) for split in splits]
    return LayerRates(*(statistics.median(getattr(r, f.name) for r in rates)
                        for f in fields(LayerRates)))


def _profiled(fn) -> tuple[float, float, float, float]:
    """(seconds, matmul, attention, element-wise) of one run of ``fn``: the wall time, what
    the profiler attributes to matmul and attention kernels, and the rest."""
    from torch.profiler import ProfilerActivity, profile
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = timed(fn)  # the profiler adds ~1 ms over ~1 s
    matmul = attention = 0.0
    for event in prof.key_averages():
        if event.key in _MATMUL_OPS:
            matmul += event.self_cpu_time_total / 1e6
        elif _ATTENTION_MARK in event.key:
            attention += event.self_cpu_time_total / 1e6
    if not matmul or not attention:
        raise TierflowError(f"the profiler saw no {'matmul' if not matmul else 'attention'} "
                            f"kernels in the probe layer (this torch names them otherwise): "
                            f"calibration needs {_MATMUL_OPS} and {_ATTENTION_MARK}* ops")
    return seconds, matmul, attention, max(seconds - matmul - attention, 1e-3 * seconds)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 on /dev/null meanwhile: the profiler's C++ side prints a line at
    its start and stop ("USDT: ... profiler_start") that no flag turns off. Python's own
    errors are raised after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rates(shape: ModelShape, step: StepShape, regime: str, peak: float, memory_bw: float,
           seconds: float, matmul: float, attention: float, elementwise: float) -> LayerRates:
    """The fractions that price the probe's parts at the seconds they took (forward and
    backward: the backward costs twice the forward's FLOPs)."""
    fwd_bytes, bwd_bytes = layer_traffic(shape, step, regime)
    return LayerRates(
        matmul_efficiency=3 * dense_flops(shape, step) / (matmul * peak),
        attention_efficiency=3 * attention_flops(shape, step) / (attention * peak),
        memory_efficiency=(fwd_bytes + bwd_bytes) / (elementwise * memory_bw),
        layer_seconds=seconds)


def timed(fn) -> float:
    """Seconds one call of ``fn`` takes (never 0: rates divide by it)."""
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)
