"""Time one eager Llama decoder layer here and split its time into matmuls, attention and
the rest: what ``tierflow calibrate`` prices layers from (``sim/layer_rates.py``).

Micro-benchmarks of each part alone are too kind: in a real layer the matmuls read
transposed operands and write fresh outputs, and the element-wise work is many small eager
kernels, dtype casts under autocast and Python between them. So the probe runs one decoder
layer of a probe shape (not a shape the calibration table checks) forward and backward as
the CPU trainer does by default (under bf16 autocast where the CPU computes bf16 natively,
else in fp32) and attributes its time with ``torch.profiler``. torch is imported when the
probe runs.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..core.errors import TierflowError
from .machine import timed

# hidden 1024, 16 heads of 64, 4 KV heads, SwiGLU 2816
PROBE_CONFIG = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 1024,
                "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
                "vocab_size": 256, "max_position_embeddings": 1024}
# (sequence length, batch) by matmul dtype: 4 sequences of 1024 tokens (1 in fp32: about a
# second a pass either way)
PROBE_TOKENS = {"bf16": (1024, 4), "fp32": (1024, 1)}
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
_ATTENTION_MARK = "scaled_dot_product"  # flash attention's forward and backward kernels


@dataclass(frozen=True)
class LayerSplit:
    """Seconds of one forward + backward of the probe layer, and how the profiler splits
    them: matmul kernels, attention kernels and the rest (element-wise work and Python)."""

    seconds: float
    matmul: float
    attention: float
    elementwise: float


def time_probe_layer(matmuls: str, repeats: int = 5) -> list[LayerSplit]:
    """``repeats`` timed forward + backward passes of the probe layer with ``matmuls``
    ("bf16": under autocast; "fp32"), after two warm-up passes, each split by the profiler."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in PROBE_CONFIG.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    seq, batch = PROBE_TOKENS[matmuls]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
        x = torch.randn(batch, seq, config.hidden_size, requires_grad=True)  # (b, s, h)
    positions = torch.arange(seq)[None].expand(batch, -1)  # (b, s)

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=matmuls == "bf16"):
            out = layer(x, position_embeddings=rope(x, positions))
            out = out[0] if isinstance(out, tuple) else out  # (b, s, h)
        out.float().sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(2):  # warm-up: kernels chosen, malloc's caches filled
        forward_backward()
    return [_profiled(forward_backward) for _ in range(repeats)]


def _profiled(fn: Callable[[], None]) -> LayerSplit:
    """One run of ``fn``: the wall time, what the profiler attributes to matmul and attention
    kernels, and the rest."""
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
    return LayerSplit(seconds, matmul, attention,
                      max(seconds - matmul - attention, 1e-3 * seconds))


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
