"""Stochastic rounding from float32 to bfloat16, unbiased and reproducible from a Generator.

bf16 is the upper half of a float32's bits. Adding a uniform random integer in [0, 2^16) to the
low half and then truncating rounds the magnitude up with probability (low half) / 2^16, which
is exactly the fractional position of the value between its two bf16 neighbours: the expected
result is the float32 value itself. Round-to-nearest is biased for small updates: an update
below half a bf16 ulp of the weight (2^-9 relative) is lost every time, so bf16 weights without
a master copy, and bf16 moments decaying by 0.999, would stop moving.

The random bits come from the caller's ``torch.Generator`` only (never the global RNG), so a
training run that checkpoints ``generator.get_state()`` resumes bit for bit. On the CPU,
PyTorch's generator (a Mersenne twister) draws on one core, about 2.6 ns a number: for the
three roundings of a bf16 AdamW step that was 90% of the step (``benchmarks/host_adamw.py``).
So a CPU tensor's noise is drawn in slices of NOISE_SLICE elements, each from a generator of
its own seeded by one draw of the caller's, the slices on all cores at once: the same bits
for the same generator state however many cores there are.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch

_LOW_BITS = 1 << 16
NOISE_SLICE = 1 << 18  # elements of noise one slice's own generator draws


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
    noise = work[:n].view(torch.int32)
    _draw_noise(noise, generator)
    # sign-magnitude: adding to the bit pattern grows the magnitude, the mask truncates it.
    # +-inf (zero mantissa) comes out as it went in; a NaN may come out as inf or a zero.
    rounded = noise.view(x.shape).add_(bits).bitwise_and_(-_LOW_BITS).view(torch.float32)
    out.copy_(rounded)  # exact: the low 16 bits are zero
    if n and bool(x.amax().isnan()):  # a NaN propagates through the maximum
        is_nan = torch.ne(x, x, out=work[:n].view(torch.bool)[:n].view(x.shape))  # reuses work
        out.masked_fill_(is_nan, float("nan"))
    return out


def _draw_noise(noise: torch.Tensor, generator: torch.Generator) -> None:
    """Fill the int32 vector ``noise`` with uniform integers in [0, 2^16) from
    ``generator``: on an accelerator in one draw, on the CPU slice by slice on all cores (see
    the module doc)."""
    n = noise.numel()
    if noise.device.type != "cpu" or n <= NOISE_SLICE:
        torch.randint(0, _LOW_BITS, (n,), dtype=torch.int32, device=noise.device,
                      generator=generator, out=noise)
        return
    starts = range(0, n, NOISE_SLICE)
    seeds = torch.randint(0, 2**62, (len(starts),), dtype=torch.int64,
                          generator=generator).tolist()

    def fill(k: int) -> None:
        piece = noise[starts[k]:starts[k] + NOISE_SLICE]  # (<= NOISE_SLICE,)
        own = torch.Generator().manual_seed(seeds[k])
        torch.randint(0, _LOW_BITS, piece.shape, dtype=torch.int32, generator=own, out=piece)

    list(_slice_pool().map(fill, range(len(starts))))


@cache
def _slice_pool() -> ThreadPoolExecutor:
    """The threads that draw the slices: one per core torch computes on."""
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="tierflow-noise")


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
