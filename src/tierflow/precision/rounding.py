"""Stochastic rounding from float32 to bfloat16, unbiased and reproducible from a Generator.

bf16 is the upper half of a float32's bits. Adding a uniform random integer in [0, 2^16) to the
low half and then truncating rounds the magnitude up with probability (low half) / 2^16, which
is exactly the fractional position of the value between its two bf16 neighbours: the expected
result is the float32 value itself. Round-to-nearest is biased for small updates: an update
below half a bf16 ulp of the weight (2^-9 relative) is lost every time, so bf16 weights without
a master copy, and bf16 moments decaying by 0.999, would stop moving.

The random bits come from the caller's ``torch.Generator`` only (never the global RNG), so a
training run that checkpoints ``generator.get_state()`` resumes bit for bit.
"""
from __future__ import annotations

import torch

_LOW_BITS = 1 << 16


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator,
                          work: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (float32, any shape) rounded to bfloat16 up or down at random, unbiased:
    E[result] == x for every finite x whose bf16 neighbours are finite. +-inf stays +-inf and
    NaN stays NaN (its payload is not kept); a value within one bf16 ulp of bf16's largest
    finite may round to inf, as it would in any stochastic-rounding hardware. ``generator``
    lives on ``x``'s device. ``work``: a float32 vector of at least ``x.numel()`` elements,
    not overlapping ``x``, that the rounding is computed in; ``out``: the bfloat16 tensor of
    ``x``'s shape it is written to (each allocated when not given), so that AdamW rounds into
    its state with nothing of ``x``'s size allocated. Returns ``out``."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    n = x.numel()
    bits = x.contiguous().view(torch.int32)  # same bytes, read as int32
    if work is None:
        work = torch.empty(n, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    noise = work[:n].view(torch.int32).view(x.shape)
    torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device,
                  generator=generator, out=noise)
    # sign-magnitude: adding to the bit pattern grows the magnitude, the mask truncates it.
    # +-inf (zero mantissa) comes out as it went in; a NaN may come out as inf or a zero.
    rounded = noise.add_(bits).bitwise_and_(-_LOW_BITS).view(torch.float32)  # low 16 bits 0
    out.copy_(rounded)  # exact: the low 16 bits are zero
    is_nan = torch.ne(x, x, out=work[:n].view(torch.bool)[:n].view(x.shape))  # reuses work
    return out.masked_fill_(is_nan, float("nan"))


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
