"""Stochastic rounding from float32 to bfloat16, unbiased and reproducible from a seed.

bf16 is the upper half of a float32's bits. Adding a uniform random integer in [0, 2^16) to the
low half and then truncating rounds the magnitude up with probability (low half) / 2^16, which
is exactly the fractional position of the value between its two bf16 neighbours: the expected
result is the float32 value itself. Round-to-nearest is biased for small updates: an update
below half a bf16 ulp of the weight (2^-9 relative) is lost every time, so bf16 weights without
a master copy, and bf16 moments decaying by 0.999, would stop moving.

The random integers are 16 bits of a counter-based hash (``hash32``) of each element's index
and a 32-bit seed: a function of the two, not a stream, so any slice of a tensor can be rounded on
its own (its offset names its indices), on any number of cores, and a compiled kernel
(``fused_adamw.py``) computes the same bits inside one pass over memory. PyTorch's CPU
generator draws on one core, about 2.6 ns a number, which had made the roundings of a bf16
AdamW step 90% of its time (``benchmarks/host_adamw.py``). Seeds come from the caller's
``torch.Generator`` only (never the global RNG), one per hash, so a training run that
checkpoints ``generator.get_state()`` resumes bit for bit.
"""
from __future__ import annotations

import torch

_LOW_BITS = 1 << 16
_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x5BD1E995  # the hash's multipliers, both under 2^31
HASH_SLICE = 1 << 15  # elements hashed at a time in eager mode: temporaries of 128-256 KiB


def draw_seed(generator: torch.Generator) -> torch.Tensor:
    """One seed for ``noise16`` from ``generator``: 32 random bits as an int64 0-dim tensor
    on the generator's device (read by the hash there: an accelerator's stream is not
    synchronized to bring it to the host)."""
    return torch.randint(0, 1 << 32, (), dtype=torch.int64, device=generator.device,
                         generator=generator)


def hash32(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of the integer ``index`` xor ``seed`` (only
    the low 32 bits of each count), as int32 holding the hash's 32 bits (negative where the
    top bit is set): xor-shift and multiply rounds in 32-bit arithmetic, products wrapping
    as unsigned ones do, logical shifts as arithmetic ones masked. Pure tensor arithmetic,
    so eager code and a compiled kernel give the same bits. In int64 masked to 32 bits (the
    same bits), the compiled AdamW step of bf16 weights and moments took 1.4x as long
    (``benchmarks/host_adamw.py``): vector multiplies of 64-bit integers are slow or
    emulated."""
    x = torch.bitwise_xor(index.to(torch.int32), _int32(seed))
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MIX1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MIX2
    return x ^ ((x >> 16) & 0xFFFF)


def _int32(seed: int | torch.Tensor) -> int | torch.Tensor:
    """The low 32 bits of ``seed`` as a signed 32-bit value (a tensor's as int32)."""
    if isinstance(seed, torch.Tensor):
        return seed.to(torch.int32)
    low = seed & _MASK32
    return low - (1 << 32) if low >= 1 << 31 else low


def noise16(index: torch.Tensor, seed: int | torch.Tensor, half: int = 0) -> torch.Tensor:
    """Uniform integers in [0, 2^16) as int32, one per element of the int64 ``index``: the
    low (``half`` 0) or high (1) 16 bits of ``hash32``, so that one hash serves two
    roundings."""
    return ((hash32(index, seed) >> (16 * half)) & (_LOW_BITS - 1)).to(torch.int32)


def round_bits_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with ``noise`` (int32 in [0, 2^16)) added to its low half and the low
    half cleared, as float32: the bf16 value it rounds to. Sign-magnitude: adding to the bit
    pattern grows the magnitude, the mask truncates it; +-inf (zero mantissa) comes out as it
    went in, a NaN as a NaN, inf or a zero (``stochastic_round_bf16`` puts NaNs back)."""
    return ((x.view(torch.int32) + noise) & -_LOW_BITS).view(torch.float32)


def stochastic_round_bf16(x: torch.Tensor, seed: int | torch.Tensor | torch.Generator,
                          work: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          *, offset: int = 0, half: int = 0) -> torch.Tensor:
    """``x`` (float32, any shape) rounded to bfloat16 up or down at random, unbiased:
    E[result] == x for every finite x whose bf16 neighbours are finite. +-inf stays +-inf and
    NaN stays NaN (its payload is not kept); a value within one bf16 ulp of bf16's largest
    finite may round to inf, as it would in any stochastic-rounding hardware.

    ``seed``: of the noise (an int, a 0-dim tensor on ``x``'s device, or a Generator there
    that draws one); ``offset``: the index of ``x``'s first element in the tensor the seed is
    for, so that slices rounded one by one get the bits the whole would; ``half``: which 16
    bits of the hash (``noise16``). ``work``: a float32 vector of at least ``x.numel()``
    elements, not overlapping ``x``, that the rounding is computed in; ``out``: the bfloat16
    tensor of ``x``'s shape it is written to (each allocated when not given), so that AdamW
    rounds into its state with nothing of ``x``'s size allocated. Returns ``out``."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    if isinstance(seed, torch.Generator):
        seed = draw_seed(seed)
    n = x.numel()
    flat = x.contiguous().view(-1)
    if work is None:
        work = torch.empty(n, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    rounded = work[:n]
    step = n if x.device.type != "cpu" else HASH_SLICE  # an accelerator hashes in one go
    for start in range(0, n, step):
        stop = min(start + step, n)
        index = torch.arange(offset + start, offset + stop, dtype=torch.int64, device=x.device)
        rounded[start:stop] = round_bits_bf16(flat[start:stop], noise16(index, seed, half))
    out.copy_(rounded.view(x.shape))  # exact: the low 16 bits are zero
    if n and bool(x.amax().isnan()):  # a NaN propagates through the maximum
        is_nan = torch.ne(x, x, out=work[:n].view(torch.bool)[:n].view(x.shape))  # reuses work
        out.masked_fill_(is_nan, float("nan"))
    return out


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
