"""How fast eager PyTorch runs a decoder layer here: the rates ``stages.py`` prices layers at.

The analytic model splits a layer's time into matmuls (FLOPs at a fraction of the matmul
peak), causal attention (FLOPs at its own fraction) and element-wise work (the traffic
``layer_traffic`` counts, at a fraction of memcpy's bandwidth). ``tierflow calibrate`` times
one eager decoder layer of a probe shape (``profile/layer_probe.py``) and this module turns
the split of its time into the three fractions that make the model's layer time equal the
measured one. No torch here; the probe imports it when it runs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, fields

from ..profile.layer_probe import PROBE_CONFIG, PROBE_TOKENS, LayerSplit, time_probe_layer
from .shapes import ModelShape, shape_from_config
from .stages import StepShape, attention_flops, dense_flops, layer_traffic

PROBE_STEPS = {dtype: StepShape(seq=seq, batch=batch)
               for dtype, (seq, batch) in PROBE_TOKENS.items()}


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
    under autocast; "fp32") whose matmul peak is ``peak`` FLOP/s, express each part of each
    one's time as a fraction of its peak and take the median of each fraction (the
    element-wise part is a difference of timings: one slow repeat would swing it)."""
    shape = shape_from_config(PROBE_CONFIG, "probe")
    regime = "autocast" if matmuls == "bf16" else "fp32"
    rates = [rates_of(shape, PROBE_STEPS[matmuls], regime, peak, memory_bw, split)
             for split in time_probe_layer(matmuls, repeats)]
    return LayerRates(*(statistics.median(getattr(r, f.name) for r in rates)
                        for f in fields(LayerRates)))


def rates_of(shape: ModelShape, step: StepShape, regime: str, peak: float, memory_bw: float,
             split: LayerSplit) -> LayerRates:
    """The fractions that price the probe's parts at the seconds they took (forward and
    backward: the backward costs twice the forward's FLOPs)."""
    fwd_bytes, bwd_bytes = layer_traffic(shape, step, regime)
    return LayerRates(
        matmul_efficiency=3 * dense_flops(shape, step) / (split.matmul * peak),
        attention_efficiency=3 * attention_flops(shape, step) / (split.attention * peak),
        memory_efficiency=(fwd_bytes + bwd_bytes) / (split.elementwise * memory_bw),
        layer_seconds=split.seconds)
