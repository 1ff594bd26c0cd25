"""Analytic stage costs: the ChainCosts of a training step, from a model's shape alone.

The chain is the one ``chain/hf.py`` cuts (embeddings, each decoder layer, final norm +
chunked LM head + loss), so the same rotor and ``make_plan`` that plan a profiled run plan
this one. FLOPs are matmul FLOPs, attention scores included and causal (half of the s x s
products); the backward costs twice the forward. Activation bytes per token follow the
precision regime (see ``ACTIVATION_COEFFS``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.costs import ChainCosts, StageCost
from .hardware import Hardware, effective_attention_flops, effective_flops
from .precision import RunPrecision
from .shapes import ModelShape

# Bytes per token a decoder layer keeps for backward beyond its input and output, as
# (per hidden, per kv width, per MLP width) for a gated MLP; a plain MLP keeps half the MLP
# term. fp32 and autocast (fp32 residual stream, bf16 matmuls) were measured with the
# profiler's saved-tensor hooks on Llama layers (h = 256, kv = 64 and 256, i = 512 and 704):
# fp32 28h + 8kv + 16i, autocast 26h + 4kv + 8i (the bf16 copies of the layer's weights the
# matmuls save are left out of the tape and made again in backward: exec/recast.py).
# "low" (bf16 everywhere, fused kernels) is DESIGN's 12h + 4kv + 6i less the 2h input.
ACTIVATION_COEFFS = {"fp32": (28, 8, 16), "autocast": (26, 4, 8), "low": (10, 4, 6)}
# Element-wise traffic of a stage, as (forward, backward) multiples of the activation bytes
# it keeps: eager PyTorch writes and reads them about twice in the forward and four times in
# the backward; fused GPU kernels ("low") about half of that.
TRAFFIC = {"fp32": (2.0, 4.0), "autocast": (2.0, 4.0), "low": (1.0, 2.0)}
# The fused head's chunk logits (fp32) while a forward runs, as a multiple of chunk x vocab x
# 4 bytes (measured: 1.34 with autocast, 0.84 in fp32; without tape 2.97 and 1.97)
HEAD_TRANSIENT = {"fp32": (0.85, 2.0), "autocast": (1.35, 3.0), "low": (1.35, 3.0)}
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


def step_flops(shape: ModelShape, step: StepShape) -> float:
    """Training matmul FLOPs of one micro-batch (forward + backward = 3 x forward)."""
    return 3.0 * (shape.layers * layer_flops(shape, step) + head_flops(shape, step))


def layer_activation_bytes(shape: ModelShape, step: StepShape, regime: str) -> int:
    """Bytes one decoder layer keeps for backward beyond its input and output."""
    ch, ckv, ci = ACTIVATION_COEFFS[regime]
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
                 head_chunk: int = HEAD_CHUNK) -> float:
    """Bytes the fused LM head's element-wise passes move (kernels/linear_cross_entropy.py).

    Per chunk of fp32 logits L: the max (L), subtracting it (2L), exp (2L), the sum (L) and
    the scaled softmax gradient (2L); with bf16 matmuls also the logits' copy to fp32 and the
    gradient's back (1.5L each) and the chunk's weight gradient added into the fp32
    accumulator (10 bytes per weight); once per step the weight's cast to bf16 under autocast
    (6 bytes per weight).
    """
    chunk = min(head_chunk, step.tokens)
    chunks = step.tokens / chunk
    logits = chunk * shape.vocab * 4
    weights = shape.vocab * shape.hidden
    if regime == "fp32":
        return chunks * 8 * logits
    cast = 6 * weights if regime == "autocast" else 0
    return chunks * (11 * logits + 10 * weights) + cast


def chain_costs(shape: ModelShape, step: StepShape, precision: RunPrecision, hw: Hardware, *,
                reserved: int = 0, head_chunk: int = HEAD_CHUNK) -> ChainCosts:
    """The costs the profiler would measure for one micro-batch on ``hw``.

    ``param_bytes`` are in the model dtype; ``static_bytes`` holds the parameters, the
    runtime and ``reserved`` (e.g. the optimizer states the caller keeps on this tier);
    ``head_chunk``: tokens per chunk of the fused LM head's logits.
    """
    regime = precision.regime
    flops = effective_flops(hw, precision.matmul)
    attention_rate = effective_attention_flops(hw, precision.matmul)
    # one layer's forward matmul time, attention at the rate its kernels reach
    layer_seconds = dense_flops(shape, step) / flops + attention_flops(shape, step) / attention_rate
    memory = hw.memory_bw * hw.memory_efficiency
    act = 4 if regime == "fp32" or regime == "autocast" else 2  # residual stream width
    width = 4 if precision.model == "fp32" else 2
    x_bytes = step.tokens * shape.hidden * act

    # a forward under autocast casts the layer's weights to bf16, with a tape or without:
    # the copies are transient (the tape leaves them out, exec/recast.py)
    casts = 2 * shape.layer_matmul_params() if regime == "autocast" else 0
    fwd_bytes, bwd_bytes = layer_traffic(shape, step, regime)

    def timed(name: str, matmul_seconds: float, tape: int, params: int) -> StageCost:
        fwd = matmul_seconds + fwd_bytes / memory
        bwd = 2 * matmul_seconds + bwd_bytes / memory
        return StageCost(name, fwd, bwd, params * width, x_bytes, tape,
                         fwd_transient=casts, fwd_transient_nograd=casts)

    tied = shape.vocab * shape.hidden if shape.tied else 0  # its gradient is "shared"
    embed = StageCost("embed", x_bytes / memory,
                      (shape.embed_params() * width + x_bytes) / memory,
                      (shape.embed_params() - tied) * width, x_bytes, 0, input_grad=False)
    layer_tape = layer_activation_bytes(shape, step, regime)
    layers = [timed(f"layers.{i}", layer_seconds, layer_tape, shape.layer_params())
              for i in range(shape.layers)]
    chunk = min(head_chunk, step.tokens)
    logits = chunk * shape.vocab * 4
    tape_factor, nograd_factor = HEAD_TRANSIENT[regime]
    head_tape = step.tokens * (2 * act * shape.hidden + 4) + shape.vocab * shape.hidden * 4
    # the fused head computes its gradients during the forward: all its FLOPs are there
    head = StageCost("head", 3 * head_flops(shape, step) / flops
                     + head_traffic(shape, step, regime, head_chunk) / memory,
                     head_tape / memory,
                     shape.head_params() * width, 4, head_tape,
                     fwd_transient=int(tape_factor * logits),
                     fwd_transient_nograd=int(nograd_factor * logits))
    params = shape.total_params() * width
    runtime = RUNTIME_BYTES if not hw.has_gpu else 0
    return ChainCosts(stages=(embed, *layers, head), input_bytes=step.tokens * 8,
                      context_bytes=step.seq * shape.head_dim * 4 * 2,
                      static_bytes=params + runtime + reserved,
                      shared_grad_bytes=tied * width,
                      extra={"parameters": params, "reserved": reserved, "runtime": runtime,
                             "source": "analytic", "regime": regime, "head chunk": chunk})
