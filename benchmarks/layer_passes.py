"""One tinyllama-1.1b decoder layer (hidden 2048, MLP 5632, 32 heads, 4 KV heads; batch 2,
seq 1024, bf16 autocast) timed through the three passes a checkpointed training step runs
per layer: the forward without grad, the forward with grad and the backward. Shared by the
benchmarks that ask what slows that compute down. Not a benchmark itself."""
from __future__ import annotations

import statistics
import time


def time_layer_passes(repeats: int) -> dict:
    """Median seconds of each pass over the repeats after the first (a warm-up)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from tierflow.models.presets import preset_config

    config = preset_config("tinyllama-1.1b")
    config._attn_implementation = "sdpa"
    layer, rope = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    x = torch.randn(2, 1024, config.hidden_size, requires_grad=True)  # (batch, seq, hidden)
    positions = torch.arange(1024)[None].expand(2, -1)  # (batch, seq)
    times = []
    for _ in range(repeats):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            embeddings = rope(x, positions)
            t0 = time.perf_counter()
            with torch.no_grad():
                layer(x, position_embeddings=embeddings)
            t1 = time.perf_counter()
            out = layer(x, position_embeddings=embeddings)
            out = out[0] if isinstance(out, tuple) else out  # (batch, seq, hidden)
            t2 = time.perf_counter()
        out.float().sum().backward()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    steady = times[1:]
    return {"forward_s": statistics.median(t[0] for t in steady),
            "forward_grad_s": statistics.median(t[1] for t in steady),
            "backward_s": statistics.median(t[2] for t in steady),
            "threads": torch.get_num_threads()}


def all_passes(row: dict) -> float:
    return row["forward_s"] + row["forward_grad_s"] + row["backward_s"]
