"""Blockwise 8-bit storage of AdamW's moments: one float32 scale per BLOCK (256) elements.

Each block is scaled by its absolute maximum ``a`` (so the block's values fall in [-1, 1]) and
then companded by a power law before uniform rounding to Q levels: code q = round(Q u) with
u = (|x| / a)^(1/p), decoded as x' = sign(x) a (q / Q)^p. Companding spends the codes where
Adam's moments live, near zero, instead of spreading them evenly up to the block maximum:

- m (first moment, signed): int8 in [-127, 127], p = 2 (square root), Q = 127;
- v (second moment, >= 0, ~ gradient^2, so its range is the square of m's): uint8 in [0, 255],
  p = 4 (fourth root: linear in sqrt(v), which is what divides the update), Q = 255.

Uniform decay (v <- 0.999 v) moves the scale, not the codes, so it is never rounded away.

Error bound (guaranteed, tested element-wise): with u as above and d = 1 / (2Q),

    |x - x'| <= a ((u + d)^p - u^p)

because |u - q/Q| <= d. For m: at most a (2/254 + 1/254^2) ~ 0.0079 a anywhere, and
relative to |x| at most (1 + d/u)^2 - 1. For v: at most a (4d + 6d^2 + ...) ~ 0.0079 a, and
sqrt(v') is within a^(1/2) ((u + d)^2 - u^2) of sqrt(v). Values below a (d)^p round to zero:
m below 1.6e-5 a, sqrt(v) below 3.8e-6 sqrt(a).

Storage is padded to a whole block: ``n`` elements take ceil(n / BLOCK) * BLOCK bytes of codes
and 4 bytes of scale per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import BLOCK


@dataclass(frozen=True)
class Mapping:
    """How one moment is companded: the code dtype, its largest code Q and the power p."""
    dtype: torch.dtype
    levels: int
    power: int

    @property
    def signed(self) -> bool:
        return self.dtype == torch.int8


SIGNED = Mapping(torch.int8, 127, 2)  # m
UNSIGNED = Mapping(torch.uint8, 255, 4)  # v
_TINY = torch.finfo(torch.float32).tiny


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def empty_codes(numel: int, mapping: Mapping, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed storage for ``numel`` elements: codes (blocks * BLOCK,) and scales (blocks,)."""
    n = blocks(numel)
    return (torch.zeros(n * BLOCK, dtype=mapping.dtype, device=device),
            torch.zeros(n, dtype=torch.float32, device=device))


def quantize_(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              mapping: Mapping, work: torch.Tensor | None = None) -> None:
    """Write float32 ``x`` (any shape, ``numel`` elements) into ``codes`` and ``scales`` (as
    made by ``empty_codes``) in place. The codes are computed in ``work``, a float32 vector
    of at least ``codes.numel()`` elements (allocated when not given): nothing else of
    ``x``'s size is allocated, so AdamW can hand it a vector of its workspace."""
    size, n = codes.numel(), x.numel()
    work = torch.empty(size, dtype=torch.float32, device=x.device) if work is None \
        else work[:size]
    flat = x.reshape(-1)  # (n,)
    work[:n].copy_(flat)
    work[n:].zero_()  # the padding of the last block
    grid = work.view(-1, BLOCK)  # (blocks, BLOCK)
    lowest, highest = torch.aminmax(grid, dim=1)  # (blocks,) each
    # checked where it costs no wait: on an accelerator it would stop the host once per slice
    if not mapping.signed and x.device.type == "cpu" and bool((lowest < 0).any()):
        raise ValueError("the unsigned mapping stores non-negative values only")
    absmax = torch.maximum(highest, -lowest)  # (blocks,) the largest magnitude
    # u = (|x| / a)^(1/p) in [0, 1], then its code round(Q u), in place
    grid.abs_().div_(absmax.clamp_min(_TINY)[:, None]).pow_(1.0 / mapping.power)
    grid.mul_(mapping.levels).round_()
    if mapping.signed:
        work[:n].copysign_(flat)  # a code carries its value's sign
    codes.copy_(work)  # exact: integers within the code dtype's range
    scales.copy_(absmax)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, shape: torch.Size,
               mapping: Mapping) -> torch.Tensor:
    """The float32 tensor of ``shape`` stored in ``codes`` and ``scales``."""
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    return dequantize_into(out, codes, scales, mapping)[:numel].reshape(shape)


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    mapping: Mapping, work: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``codes`` and ``scales`` into the float32 vector ``out`` (as many elements as
    ``codes``, whole blocks) in place; returns ``out``. The signed mapping reads the codes'
    signs from ``work``, a float32 vector of at least as many elements that does not overlap
    ``out`` (allocated when not given): an op mixing int8 and float32 operands would make a
    float32 copy of the codes, so AdamW hands it a vector of its workspace instead."""
    q = out.view(-1, BLOCK).copy_(codes.view(-1, BLOCK))  # (blocks, BLOCK)
    q.div_(mapping.levels).abs_().pow_(mapping.power).mul_(scales[:, None])  # magnitudes
    if mapping.signed:
        if work is None:
            work = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
        signs = work[:codes.numel()].view(-1, BLOCK).copy_(codes.view(-1, BLOCK))
        q.copysign_(signs)  # a code's sign is its value's; 0 stays +0
    return out


def error_bound(x: torch.Tensor, mapping: Mapping) -> torch.Tensor:
    """The guaranteed |x - dequantize(quantize(x))| per element (see the module docstring)."""
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, blocks(flat.numel()) * BLOCK - flat.numel()))
    grid = padded.view(-1, BLOCK).abs()  # (blocks, BLOCK)
    absmax = grid.amax(dim=1, keepdim=True)  # (blocks, 1)
    u = (grid / absmax.clamp_min(_TINY)).pow(1.0 / mapping.power)
    d = 0.5 / mapping.levels
    bound = absmax * ((u + d).clamp_max(1.0).pow(mapping.power) - u.pow(mapping.power))
    return bound.reshape(-1)[:flat.numel()].reshape(x.shape)
