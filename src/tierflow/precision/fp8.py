"""fp8 matmuls: ``Float8Linear``, a drop-in for ``nn.Linear`` that multiplies in float8.

Forward: the input (M, K) and the weight (N, K) are cast to e4m3 with per-tensor scales
computed just in time (scale = absmax / 448, so each tensor uses e4m3's whole range), and
``scaled_matmul`` returns the (M, N) product in bf16, bias added. Only the two e4m3
tensors and their scales are kept for backward: 1 byte per element instead of 2 or 4.

``scaled_matmul`` is ``torch._scaled_mm`` on an accelerator. On the CPU it multiplies the same
float8 operands in an fp32 matmul: every float8 value and every product of two is exact in
fp32, and the sums are fp32 as in ``_scaled_mm``'s accumulation, so only their order differs.
torch's CPU ``_scaled_mm`` runs a reference kernel where the CPU has no fp8 instructions:
on a 2-core Xeon with AMX it took 210-950x as long as this fp32 matmul
(``benchmarks/fp8_cpu_kernel.py``), which itself takes 5-15x a bf16 matmul's time: fp8 on a
CPU checks the numerics of the GPU path, it is not a way to go faster there.

Backward, selected by ``grad_dtype``:
- "bf16": the saved e4m3 tensors are dequantized to bf16 and both gradient matmuls run in bf16;
- "e5m2": the incoming gradient is cast to e5m2 (wider range, 2 mantissa bits) with its own
  absmax scale, and both gradient matmuls run through ``scaled_matmul``.

Layout rules of ``torch._scaled_mm`` (CUDA; the CPU kernel takes any shape): the first operand
row-major, the second column-major, and the second operand's two dimensions multiples of 16.
The weight's dimensions are checked when the module is built (``Float8Linear`` refuses others;
``apply_precision`` leaves such Linears in bf16). The weight-gradient matmul's second operand
has the token count M as a dimension, so M is zero-padded to a multiple of 16 there (zero rows
add nothing to the product).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import PrecisionError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ALIGN = 16  # torch._scaled_mm on CUDA: the second operand's dimensions are multiples of 16


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in ``dtype``, scale): a per-tensor absmax scale as a float32 scalar tensor,
    such that the largest |x| lands on the format's largest finite value."""
    top = torch.finfo(dtype).max
    x32 = x.to(torch.float32)
    scale = x32.abs().amax().clamp_min(1e-12) / top  # () float32
    return (x32 / scale).clamp(-top, top).to(dtype), scale


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias in bf16 from float8 ``a`` (M, K) and ``b`` (K, N),
    summed in fp32: ``torch._scaled_mm`` on an accelerator, an fp32 matmul of the same operands
    on the CPU (see the module docstring)."""
    bias = None if bias is None else bias.to(torch.bfloat16)
    if a.device.type != "cpu":
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16, bias=bias)
    out = (a.to(torch.float32) @ b.to(torch.float32)) * (scale_a * scale_b)  # (M, N)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(torch.bfloat16)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same shape, laid out column-major (what _scaled_mm's second operand needs)."""
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` (rows, cols) with zero rows appended up to a multiple of ``multiple`` (fp8 zero is
    the all-zero byte in both formats, so padding goes through a uint8 view)."""
    extra = -t.shape[0] % multiple
    if not extra:
        return t
    padded = torch.nn.functional.pad(t.contiguous().view(torch.uint8), (0, 0, 0, extra))
    return padded.view(t.dtype)


class _Float8Matmul(torch.autograd.Function):
    """y = x @ weight.T + bias with e4m3 operands; gradients in bf16 or through e5m2."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grad_dtype: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        x8, sx = to_float8(x2, E4M3)
        w8, sw = to_float8(weight, E4M3)  # (N, K)
        out = scaled_matmul(x8, w8.t(), sx, sw, bias)  # (M, N)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.grad_dtype = grad_dtype
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8, sx, w8, sw = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if ctx.grad_dtype == "bf16":
            gb = g.to(torch.bfloat16)
            if need_x:
                w = (w8.to(torch.float32) * sw).to(torch.bfloat16)  # (N, K)
                grad_x = gb @ w  # (M, K)
            if need_w:
                x = (x8.to(torch.float32) * sx).to(torch.bfloat16)  # (M, K)
                grad_w = gb.t() @ x  # (N, K)
        else:
            g8, sg = to_float8(g, E5M2)
            if need_x:
                grad_x = scaled_matmul(g8, _column_major(w8), sg, sw)  # (M, K)
            if need_w:
                g8t = _pad_rows(g8, ALIGN).t().contiguous()  # (N, M padded)
                grad_w = scaled_matmul(g8t, _column_major(_pad_rows(x8, ALIGN)), sg,
                                       sx)  # (N, K)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        if need_b:
            grad_b = g.to(torch.float32).sum(0).to(ctx.bias_dtype)  # (N,)
        return grad_x, grad_w, grad_b, None


class Float8Linear(nn.Module):
    """Runs ``linear``'s matmul in fp8 (see the module docstring); holds ``linear``'s own
    ``weight`` and ``bias`` Parameters under the same names, so state dicts, optimizers and
    checkpoints see no difference. ``grad_dtype``: "bf16" or "e5m2"."""

    def __init__(self, linear: nn.Linear, grad_dtype: str = "bf16"):
        super().__init__()
        if grad_dtype not in ("bf16", "e5m2"):
            raise PrecisionError(f"grad_dtype={grad_dtype!r} is unknown: use bf16 or e5m2")
        n, k = linear.weight.shape
        if n % ALIGN or k % ALIGN:
            raise PrecisionError(f"a Linear of {k} -> {n} features cannot run in fp8: "
                                 f"torch._scaled_mm needs multiples of {ALIGN}; keep it in bf16")
        self.in_features, self.out_features = k, n
        self.weight = linear.weight
        self.bias = linear.bias
        self.grad_dtype = grad_dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, grad_dtype={self.grad_dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N) bf16
        return _Float8Matmul.apply(x, self.weight, self.bias, self.grad_dtype)
