"""Analytic stage costs: the ChainCosts of a training step, from a model's shape alone.

The chain is the one ``chain/hf.py`` cuts (embeddings, each decoder layer, final norm +
chunked LM head + loss), so the same rotor and ``make_plan`` that plan a profiled run plan
this one. FLOPs are matmul FLOPs, attention scores included and causal (half of the s x s
products); the backward costs twice the forward when everything trains (a partial
fine-tune's ``Selection`` says what each stage's backward computes). Activation bytes per
token follow the precision regime (see ``ACTIVATION_COEFFS``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.costs import ChainCosts, SelectiveCost, StageCost
from ..precision.config import PrecisionConfig
from ..profile.head_chunk import HEAD_TRANSIENT
from .hardware import Hardware, effective_attention_flops, effective_flops
from .selection import Selection
from .shapes import ModelShape

# Bytes per token a decoder layer keeps for backward beyond its input and output, as
# (per hidden, per kv width, per MLP width) for a gated MLP; a plain MLP keeps half the MLP
# term. fp32 and autocast (fp32 residual stream, bf16 matmuls) were measured with the
# profiler's saved-tensor hooks on Llama layers (h = 256, kv = 64 and 256, i = 512 and 704):
# fp32 28h + 8kv + 16i, autocast 26h + 4kv + 8i (the bf16 copies of the layer's weights the
# matmuls save are left out of the tape and made again in backward: exec/recast.py).
# "low" (bf16 everywhere, fused kernels) is DESIGN's 12h + 4kv + 6i less the 2h input.
ACTIVATION_COEFFS = {"fp32": (28, 8, 16), "autocast": (26, 4, 8), "low": (10, 4, 6)}
# What a selective forward keeps of it (exec/selective.py): the matmul and attention outputs,
# per token q and attention's output (h each), k and v (kv each), the output projection's and
# the MLP down projection's (h each; their consumers are residual adds, but a kept op is
# kept whoever reads it), the gate and up projections (i each; a plain MLP's one, half):
# 4h + 2kv + 2i elements, in the matmuls' dtype (bf16 under autocast), and attention's
# log-sum-exp (the 4 bytes per head of ``layer_activation_bytes``). The norms, rotary
# embeddings, activations and residual adds are recomputed.
SELECTIVE_COEFFS = {"fp32": (16, 8, 8), "autocast": (8, 4, 4), "low": (8, 4, 4)}
# Element-wise traffic of a stage, as (forward, backward) multiples of the activation bytes
# it keeps: eager PyTorch writes and reads them about twice in the forward and four times in
# the backward; fused GPU kernels ("low") about half of that.
TRAFFIC = {"fp32": (2.0, 4.0), "autocast": (2.0, 4.0), "low": (1.0, 2.0)}
HEAD_CHUNK = 1024
# What `tierflow train` on the CPU keeps resident above its post-import RSS besides tensors:
# about 134 MiB before it plans (torch's kernels and thread pools on first use; measured the
# same building llama-20m and tinyllama-1.1b) and about 35 MiB more that profiling leaves
RUNTIME_BYTES = 170 << 20


@dataclass(frozen=True)
class StepShape:
    """One micro-batch: ``batch`` sequences of ``seq`` tokens."""

    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


def layer_flops(shape: ModelShape, step: StepShape) -> float:
    """Forward matmul FLOPs of one decoder layer: projections, MLP and causal attention."""
    return dense_flops(shape, step) + attention_flops(shape, step)


def dense_flops(shape: ModelShape, step: StepShape) -> float:
    """Forward FLOPs of one decoder layer's projections and MLP."""
    return 2.0 * step.tokens * shape.layer_matmul_params()


def attention_flops(shape: ModelShape, step: StepShape) -> float:
    """Forward FLOPs of one decoder layer's causal attention: QK^T and AV, half of s x s."""
    return 2.0 * step.batch * step.seq * step.seq * shape.q_width


def head_flops(shape: ModelShape, step: StepShape) -> float:
    return 2.0 * step.tokens * shape.hidden * shape.vocab


def step_flops(shape: ModelShape, step: StepShape, selection: Selection | None = None) -> float:
    """Training matmul FLOPs of one micro-batch: 3 x the forward's when everything trains;
    under a partial fine-tune, what ``layer_factors`` and ``head_factor`` count."""
    sel = selection or Selection.everything(shape)
    layers = sum(dense * dense_flops(shape, step) + attention * attention_flops(shape, step)
                 for dense, attention in (layer_factors(shape, sel, i)
                                          for i in range(1, shape.layers + 1)))
    return layers + head_factor(sel) * head_flops(shape, step)


def layer_factors(shape: ModelShape, sel: Selection, i: int) -> tuple[float, float]:
    """(dense, attention): the FLOPs of stage i's training, forward and backward, as
    multiples of its forward's projections and MLP and of its forward's attention. A stage
    with a backward computes its matmuls' input gradients and the weight gradients of the
    ones that train; attention's backward is twice its forward. Every matmul's input
    gradient is counted, also in the first layer that trains, where autograd skips those
    below its lowest trainable weight (exact when whole layers train). Full training:
    (3, 3)."""
    if not sel.needs_backward(i):
        return 1.0, 1.0
    return 2.0 + sel.matmul[i] / shape.layer_matmul_params(), 3.0


def head_factor(sel: Selection) -> float:
    """The fused LM head's FLOPs as a multiple of its forward's: the logits, the input's
    gradient when something before the head trains, the weight's when it trains."""
    last = len(sel.trainable) - 1
    return 1.0 + sel.input_grad(last) + sel.head_weight_trains


def layer_activation_bytes(shape: ModelShape, step: StepShape, regime: str,
                           selective: bool = False) -> int:
    """Bytes one decoder layer keeps for backward beyond its input and output (``selective``:
    those of a selective forward, ``SELECTIVE_COEFFS``)."""
    ch, ckv, ci = (SELECTIVE_COEFFS if selective else ACTIVATION_COEFFS)[regime]
    ci = ci if shape.gated else ci / 2
    per_token = ch * shape.hidden + ckv * shape.kv_width + ci * shape.mlp + 4 * shape.heads + 8
    return int(per_token * step.tokens)


def layer_traffic(shape: ModelShape, step: StepShape, regime: str) -> tuple[float, float]:
    """Bytes a decoder layer's element-wise work moves in its forward and in its backward:
    its kept activations written and read (``TRAFFIC``) and, under autocast, its weights cast
    to bf16 in the forward and again in the backward (4 bytes read and 2 written per weight)."""
    fwd_traffic, bwd_traffic = TRAFFIC[regime]
    tape = layer_activation_bytes(shape, step, regime)
    cast = 6 * shape.layer_matmul_params() if regime == "autocast" else 0
    return fwd_traffic * tape + cast, bwd_traffic * tape + cast


def head_traffic(shape: ModelShape, step: StepShape, regime: str,
                 head_chunk: int = HEAD_CHUNK, weight_grad: bool = True) -> float:
    """Bytes the fused LM head's element-wise passes move (kernels/linear_cross_entropy.py).

    Per chunk of fp32 logits L: the max (L), subtracting it (2L), exp (2L), the sum (L) and
    the scaled softmax gradient (2L); with bf16 matmuls also the logits' copy to fp32 and the
    gradient's back (1.5L each) and the chunk's weight gradient added into the fp32
    accumulator (10 bytes per weight, unless ``weight_grad`` is False: a frozen head); once
    per step the weight's cast to bf16 under autocast (6 bytes per weight).
    """
    chunk = min(head_chunk, step.tokens)
    chunks = step.tokens / chunk
    logits = chunk * shape.vocab * 4
    weights = shape.vocab * shape.hidden
    if regime == "fp32":
        return chunks * 8 * logits
    cast = 6 * weights if regime == "autocast" else 0
    return chunks * (11 * logits + 10 * weights * weight_grad) + cast


def chain_costs(shape: ModelShape, step: StepShape, precision: PrecisionConfig, hw: Hardware, *,
                reserved: int = 0, head_chunk: int = HEAD_CHUNK,
                selection: Selection | None = None) -> ChainCosts:
    """The costs the profiler would measure for one micro-batch on ``hw``.

    ``param_bytes`` are in the model dtype; ``static_bytes`` holds the parameters, the
    runtime and ``reserved`` (e.g. the optimizer states the caller keeps on this tier);
    ``head_chunk``: tokens per chunk of the fused LM head's logits; ``selection``: what
    trains (None: everything). Frozen weights are ``frozen_bytes``; the stages before the
    first that trains have no backward; a frozen matmul costs no weight gradient.
    """
    sel = selection or Selection.everything(shape)
    regime = precision.regime
    flops = effective_flops(hw, precision.matmul_dtype)
    attention_rate = effective_attention_flops(hw, precision.matmul_dtype)
    # one layer's forward matmul time, attention at the rate its kernels reach
    dense_seconds = dense_flops(shape, step) / flops
    attention_seconds = attention_flops(shape, step) / attention_rate
    memory = hw.memory_bw * hw.memory_efficiency
    act = 4 if regime == "fp32" or regime == "autocast" else 2  # residual stream width
    width = 4 if precision.model_dtype == "fp32" else 2
    x_bytes = step.tokens * shape.hidden * act

    # a forward under autocast casts the layer's weights to bf16, with a tape or without:
    # the copies are transient (the tape leaves them out, exec/recast.py)
    casts = 2 * shape.layer_matmul_params() if regime == "autocast" else 0
    fwd_bytes, bwd_bytes = layer_traffic(shape, step, regime)

    def trains(i: int, params: int) -> dict:
        """Stage i's parameter bytes, trainable and frozen, and whether it backpropagates."""
        return {"param_bytes": sel.trainable[i] * width,
                "frozen_bytes": (params - sel.trainable[i]) * width,
                "input_grad": sel.input_grad(i), "needs_backward": sel.needs_backward(i)}

    layer_tape = layer_activation_bytes(shape, step, regime)
    kept = layer_activation_bytes(shape, step, regime, selective=True)
    # a selective backward first runs the forward's element-wise work (and weight casts)
    # again, its matmuls and attention read from the tape, and holds what it recomputed
    selective = SelectiveCost(kept, fwd_bytes / memory, fwd_transient=casts,
                              bwd_transient=casts + layer_tape - kept)

    def layer(i: int) -> StageCost:
        dense, attention = layer_factors(shape, sel, i)
        backward = (dense - 1) * dense_seconds + (attention - 1) * attention_seconds
        return StageCost(f"layers.{i - 1}", dense_seconds + attention_seconds
                         + fwd_bytes / memory,
                         backward + bwd_bytes / memory if sel.needs_backward(i) else 0.0,
                         output_bytes=x_bytes, tape=layer_tape, fwd_transient=casts,
                         fwd_transient_nograd=casts, selective=selective,
                         **trains(i, shape.layer_params()))

    tied = shape.vocab * shape.hidden if shape.tied else 0  # shared: in neither stage
    embed = StageCost("embed", x_bytes / memory,
                      (shape.embed_params() * width + x_bytes) / memory
                      if sel.needs_backward(0) else 0.0,
                      output_bytes=x_bytes, tape=0, **trains(0, shape.embed_params() - tied))
    layers = [layer(i) for i in range(1, shape.layers + 1)]
    chunk = min(head_chunk, step.tokens)
    logits = chunk * shape.vocab * 4
    tape_factor, nograd_factor = HEAD_TRANSIENT[regime]
    # the head keeps its input and its weight's float32 gradient, made in the forward
    head_tape = step.tokens * (2 * act * shape.hidden + 4) \
        + shape.vocab * shape.hidden * 4 * sel.head_weight_trains
    # the fused head computes its gradients during the forward: all its FLOPs are there
    head = StageCost("head", head_factor(sel) * head_flops(shape, step) / flops
                     + head_traffic(shape, step, regime, head_chunk,
                                    weight_grad=sel.head_weight_trains) / memory,
                     head_tape / memory, output_bytes=4, tape=head_tape,
                     fwd_transient=int(tape_factor * logits),
                     fwd_transient_nograd=int(nograd_factor * logits),
                     **trains(shape.layers + 1, shape.head_params()))
    params = shape.total_params() * width
    runtime = RUNTIME_BYTES if not hw.has_gpu else 0
    return ChainCosts(stages=(embed, *layers, head), input_bytes=step.tokens * 8,
                      context_bytes=step.seq * shape.head_dim * 4 * 2,
                      static_bytes=params + runtime + reserved,
                      shared_grad_bytes=sel.tied * width,
                      extra={"parameters": params, "reserved": reserved, "runtime": runtime,
                             "source": "analytic", "regime": regime, "head chunk": chunk})
