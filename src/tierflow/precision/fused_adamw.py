"""AdamW's step in one pass over memory: the arithmetic of ``adamw.AdamW`` (float32 working
values; for bf16 storage without a master, or bf16 moments, the stochastic roundings of
``rounding.py`` with the same seeds and indices) compiled by ``torch.compile`` into one loop
that reads the weights (or their fp32 master), the gradient and both moments once and
writes them back once (Inductor's C++ kernel on the CPU, on all cores). Unfused, each of the
step's element-wise operations is a pass over memory of its own (about 30 for bf16 weights
and moments; 8 for fp32 ones), which left the host AdamW a fraction of the DRAM bandwidth
(``benchmarks/host_adamw.py``).

The storage a step takes (each compiled once per process, for any length): fp32 weights,
or bf16 weights with an fp32 master (rounded to nearest from it) or without one
(stochastically rounded); fp32 or bf16 moments. The first step of each takes the compiler's
seconds (Inductor caches the kernel on disk for the next process), so a step fuses only
from ``FUSED_MIN_ELEMENTS`` elements, or ``FUSED_MIN_ELEMENTS_EXACT`` where nothing rounds
stochastically (the unfused step is 10x faster there, the saving smaller). Where it cannot
be compiled (no C++ compiler), ``fused_step`` says so once and returns False, and the caller
runs its unfused slices, which compute the same bits up to float32 rounding order.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .rounding import hash32, round_bits_bf16

# per step: below, compiling costs more than it saves. With stochastic rounding, the unfused
# step took 26 ns per element on 2 cores against 2.5 fused; without, 1.7 against 0.6. The
# exact threshold is above the optimizer probe's larger step (16M elements,
# profile/optimizer_probe.py), which prices every stage's update at one rate: at or below
# the unfused one, never under what a stage below the threshold takes
FUSED_MIN_ELEMENTS = 1 << 20
FUSED_MIN_ELEMENTS_EXACT = 1 << 25
UNFUSED = "the fused AdamW kernel could not be compiled"  # how the warning begins


def hyper_parameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                     step: int) -> torch.Tensor:
    """The step's scalars as the kernel reads them, float32 (7,): the weight decay's factor,
    1 - beta1, beta2, 1 - beta2, sqrt of the second bias correction, eps, and minus the step
    size. A tensor, not Python floats, so that a learning-rate schedule does not recompile."""
    beta1, beta2 = betas
    return torch.tensor([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
                         (1 - beta2 ** step) ** 0.5, eps, -lr / (1 - beta1 ** step)],
                        dtype=torch.float32)


def _step(weights: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
          exp_avg_sq: torch.Tensor, master: torch.Tensor | None, seeds: torch.Tensor | None,
          hyper: torch.Tensor) -> None:
    """One AdamW step of flat ``weights`` (n,) and moments (n,) from ``grad`` (n,, bf16 or
    float32), in place. ``master``: float32 (n,) the update goes to, then to bf16 ``weights``
    rounded to nearest (None: the weights are the master, rounded stochastically if bf16).
    ``seeds`` int64 (2,), when anything rounds stochastically: of the hash whose low and
    high halves round bf16 exp_avg and exp_avg_sq, and of the one whose low half rounds the
    weights (``adamw.py`` draws them so); ``hyper`` from ``hyper_parameters``. The dtypes
    and the master's presence are fixed per compiled kernel (Dynamo guards on them)."""
    g = grad.float()
    w = (weights if master is None else master).float() * hyper[0]
    m = torch.lerp(exp_avg.float(), g, hyper[1])
    v = exp_avg_sq.float() * hyper[2] + g * g * hyper[3]
    denom = v.sqrt() / hyper[4] + hyper[5]
    w = w + hyper[6] * (m / denom)
    index = None
    if exp_avg.dtype == torch.bfloat16:
        index = torch.arange(weights.numel(), dtype=torch.int64, device=weights.device)  # (n,)
        moments = hash32(index, seeds[0])  # (n,) its low half rounds exp_avg, its high exp_avg_sq
        exp_avg.copy_(_rounded(m, moments & 0xFFFF))
        exp_avg_sq.copy_(_rounded(v, (moments >> 16) & 0xFFFF))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if master is not None:
        master.copy_(w)
        weights.copy_(w)  # round to nearest: the master keeps what bf16 cannot
    elif weights.dtype == torch.float32:
        weights.copy_(w)
    else:
        if index is None:
            index = torch.arange(weights.numel(), dtype=torch.int64, device=weights.device)
        weights.copy_(_rounded(w, hash32(index, seeds[1]) & 0xFFFF))


def _rounded(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (n,) stochastically rounded with int64 ``noise`` (n,) in [0, 2^16) to a
    bf16 value (still float32), a NaN kept (``x != x``: compiled, it is one vector compare)."""
    return torch.where(x != x, x, round_bits_bf16(x, noise.to(torch.int32)))


_compiled: list = []  # the compiled kernel once made; [None] where it cannot be


def kernel_unavailable() -> bool:
    """Whether compiling the kernel failed in this process (the unfused path runs then)."""
    return _compiled == [None]


def fused_step(weights: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, master: torch.Tensor | None,
               seeds: torch.Tensor | None, hyper: torch.Tensor) -> bool:
    """Run the compiled ``_step`` on flat contiguous views; False (nothing changed) where
    no kernel could be compiled, or under a dispatch mode that watches each operation (the
    optimizer probe's ``TensorLedger``): the compiled function called under one ran
    operation by operation ever after, 16x slower (a 16M-element step: 2.3 ns per element
    before, 38 after, on 2 cores), and the trainer's plans priced the host AdamW at that."""
    if _get_current_dispatch_mode() is not None:
        return False
    if not _compiled:
        _compiled.append(torch.compile(_step, dynamic=True))
    kernel = _compiled[0]
    if kernel is None:
        return False
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        kernel(weights, grad, exp_avg, exp_avg_sq, master, seeds, hyper)
    except BackendCompilerFailed as e:
        warnings.warn(f"{UNFUSED} ({e}): stepping element-wise operation by operation, "
                      "several times slower", stacklevel=2)
        _compiled[0] = None
        return False
    return True
