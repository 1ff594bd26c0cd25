"""Weight-only int8 quantization for generation: a function applied to a built model.

``quantize_int8(model)`` replaces every linear layer whose weight no other module shares
(``nn.Linear`` and the transposed ``Conv1D`` of GPT-2; not a head tied to the input embedding)
by an ``Int8Linear``: int8 weights with one scale per output channel, symmetric
(``scale = max |w| / 127`` over the row). Activations stay in the compute dtype; the product
is dequantized by the scales. On the meta device it only changes the structure, so that a
quantized checkpoint (``tierflow quantize``) can be loaded into it with ``assign=True``.

Half the bytes of bf16 weights (a quarter of fp32) to hold in RAM or to read per token when
streaming, and decoding reads its weights once per token, so fewer bytes are faster too. The
price is rounding: each weight moves by at most half a step, 1/254 of its row's largest
magnitude, which left a relative error near 1% in the products of random Gaussian weights
(``tests/test_quantize.py``; ``benchmarks/int8_quality.py`` measures a trained model).
Training never sees these layers (``load_model`` refuses a quantized checkpoint unless it is
for generation).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import TierflowError

QUANTIZATION_KEY = "tierflow_quantization"  # in config.json: {"weights": "int8", ...}
INT8 = {"weights": "int8", "scales": "one per output channel, symmetric"}
# torch's fused CPU kernel (``_weight_int8pack_mm``) reads the inner dimension in blocks of 16
# (other widths give wrong sums) with aligned vector loads: a weight or an input row off a
# 32-byte boundary crashes it (a memory-mapped weight can sit anywhere in its file).
_FUSED_BLOCK = 32
_ALIGN = 64
# Above these many rows (tokens) the kernel, made for decoding, is slower than converting the
# weight and running the dtype's matmul (``benchmarks/int8_kernel.py`` on 5632 x 2048: in
# bf16 1.57 ms against 1.78 at 24 rows, 2.13 against 2.09 at 32; in fp32, where the kernel is
# scalar, 7.00 against 15.81 at 2 rows, 14.95 against 15.48 at 4, 29.20 against 15.75 at 8).
# A long prompt's prefill takes the matmul.
_FUSED_MAX_ROWS = {torch.bfloat16: 24, torch.float16: 24, torch.float32: 3}
_HAS_FUSED = hasattr(torch.ops.aten, "_weight_int8pack_mm")  # torch 2.3 and later


class Int8Linear(nn.Module):
    """``y = (x @ weight.T) * scales + bias`` with ``weight`` int8 (out, in) and ``scales``
    (out,) in the compute dtype; neither is trained."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8,
                                               device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        if self.fused(x):
            flat = x.reshape(-1, self.in_features).contiguous()  # (tokens, in)
            if flat.data_ptr() % _ALIGN:  # a view into a longer sequence (the last position)
                flat = flat.clone()
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through torch's fused CPU kernel (see ``_FUSED_MAX_ROWS``)."""
        return (_HAS_FUSED and x.device.type == "cpu" and x.dtype == self.scales.dtype
                and x.numel() // self.in_features <= _FUSED_MAX_ROWS.get(x.dtype, 0)
                and self.in_features % _FUSED_BLOCK == 0
                and self.weight.data_ptr() % _ALIGN == 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int8")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight (out, in), fp32 scales (out,)) of a float ``weight`` (out, in): each row
    divided by its largest magnitude over 127 and rounded to the nearest integer, so every
    element is off by at most half its row's scale (an all-zero row gets scale 0)."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127  # (out,)
    q = torch.round(w / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp(-127, 127).to(torch.int8), scales


def quantizable(model: nn.Module) -> dict[str, bool]:
    """{name: stored transposed} of the linear layers ``quantize_int8`` replaces: every
    ``nn.Linear`` (weight (out, in)) and GPT-2 ``Conv1D`` (weight (in, out)) whose weight no
    other module shares (a head tied to the input embedding stays as it is)."""
    from transformers.pytorch_utils import Conv1D
    uses: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                uses[id(param)] = uses.get(id(param), 0) + 1
    return {name: isinstance(module, Conv1D) for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Conv1D)) and uses[id(module.weight)] == 1}


def quantize_int8(model: nn.Module) -> list[str]:
    """Replace, in place, the linear layers ``quantizable`` names by ``Int8Linear`` (their
    weights quantized; on the meta device, the structure only). Returns their names."""
    layers = quantizable(model)
    for name, transposed in layers.items():
        module = model.get_submodule(name)
        weight = module.weight.t() if transposed else module.weight  # (out, in)
        n_out, n_in = weight.shape
        bias = module.bias
        new = Int8Linear(n_in, n_out, bias=bias is not None, dtype=weight.dtype,
                         device=weight.device)
        if weight.device.type != "meta":
            q, scales = quantize_weight(weight.detach())
            new.weight.data.copy_(q)
            new.scales.data.copy_(scales)
            if bias is not None:
                new.bias.data.copy_(bias.detach())
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, new)
    return list(layers)


def align_int8(model: nn.Module) -> None:
    """Give every ``Int8Linear`` weight that is off a 64-byte boundary (memory-mapped from a
    checkpoint) an aligned copy, so that the fused kernel can read it."""
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.weight.data_ptr() % _ALIGN:
            module.weight = nn.Parameter(module.weight.clone(), requires_grad=False)


def is_quantized(config: object) -> bool:
    """Whether a model config (transformers' or a config.json dict) says its weights are
    tierflow's int8; one line for a quantization this version does not know."""
    value = config.get(QUANTIZATION_KEY) if isinstance(config, dict) else getattr(
        config, QUANTIZATION_KEY, None)
    if value is None:
        return False
    if not isinstance(value, dict) or value.get("weights") != "int8":
        raise TierflowError(f"config.json says {QUANTIZATION_KEY} {value!r}, which this tierflow "
                            "does not know (it writes {'weights': 'int8'}): quantize the original "
                            "checkpoint again with tierflow quantize")
    return True
