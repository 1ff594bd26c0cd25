"""Precision numerics: the config's validation, JSON round trip and bytes per parameter; the
stochastic rounding's unbiasedness and reproducibility; the int8 moments' error bound."""
import math

import pytest
import torch

from tierflow.errors import TierflowError
from tierflow.precision import PrecisionConfig, PrecisionError, stochastic_round_bf16
from tierflow.precision.quant import (
    SIGNED,
    UNSIGNED,
    dequantize,
    empty_codes,
    error_bound,
    quantize_,
)


def test_config_json_round_trip_and_unknown_keys():
    config = PrecisionConfig(model_dtype="bf16", master="none", optim_dtype="int8",
                             matmul_dtype="fp8", fp8_grad="e5m2")
    assert PrecisionConfig.from_dict(config.to_dict()) == config
    with pytest.raises(PrecisionError, match="unknown precision keys"):
        PrecisionConfig.from_dict({"model_dtype": "bf16", "moments": "int8"})


@pytest.mark.parametrize("fields, fragments", [
    ({"master": "none"}, ["master='none'", "model_dtype='bf16'"]),
    ({"model_dtype": "bf16"}, ["model_dtype='bf16'", "matmul_dtype='bf16'"]),
    ({"fp8_grad": "e5m2", "matmul_dtype": "bf16"}, ["fp8_grad='e5m2'", "matmul_dtype='fp8'"]),
    ({"optim_dtype": "int4"}, ["optim_dtype='int4'", "int8"]),
])
def test_contradictions_are_one_line_errors(fields, fragments):
    with pytest.raises(TierflowError) as info:
        PrecisionConfig(**fields).validate("cpu")
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_fp8_without_scaled_mm_is_one_line(monkeypatch):
    from tierflow.precision import config as config_module

    config_module._runs.cache_clear()
    monkeypatch.delattr(torch, "_scaled_mm")
    try:
        with pytest.raises(PrecisionError) as info:
            PrecisionConfig(matmul_dtype="fp8").validate("cpu")
    finally:
        config_module._runs.cache_clear()  # the next probe sees the real torch again
    assert "\n" not in str(info.value) and "torch._scaled_mm" in str(info.value)
    PrecisionConfig(matmul_dtype="bf16").validate("cpu")


def test_bytes_per_parameter_are_the_design_facts():
    full = PrecisionConfig().bytes_per_parameter()
    mixed = PrecisionConfig(model_dtype="bf16", matmul_dtype="bf16").bytes_per_parameter()
    pure = PrecisionConfig(model_dtype="bf16", master="none", optim_dtype="bf16",
                           matmul_dtype="bf16").bytes_per_parameter()
    small = PrecisionConfig(model_dtype="bf16", master="none", optim_dtype="int8",
                            matmul_dtype="bf16").bytes_per_parameter()
    assert (full.total, mixed.total, pure.total) == (16, 16, 8)
    assert (mixed.weights, mixed.gradients, mixed.master, mixed.moments) == (2, 2, 4, 8)
    assert small.total - small.moment_scales == 6 and small.moment_scales == 8 / 256


def test_quantization_and_rounding_compute_in_a_given_vector():
    """AdamW hands quantize_ and stochastic_round_bf16 a vector of its workspace: the input
    is left as it was, only the vector's first elements are written, and the codes and the
    rounding equal those computed in vectors of their own."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g)  # 3 whole blocks and a partial one
    kept = x.clone()
    work = torch.full((2048,), 7.0)
    codes, scales = empty_codes(x.numel(), SIGNED, x.device)
    quantize_(x, codes, scales, SIGNED, work)
    alone, alone_scales = empty_codes(x.numel(), SIGNED, x.device)
    quantize_(x, alone, alone_scales, SIGNED)
    assert torch.equal(codes, alone) and torch.equal(scales, alone_scales)
    assert torch.equal(x, kept) and bool((work[1024:] == 7.0).all())
    first = torch.Generator().manual_seed(2)
    second = torch.Generator().manual_seed(2)
    assert torch.equal(stochastic_round_bf16(x, first, work), stochastic_round_bf16(x, second))
    assert torch.equal(x, kept)


def test_stochastic_rounding_is_unbiased():
    """Values between two bf16 neighbours lo < x < hi round to hi with probability
    p = (x - lo) / (hi - lo): the mean of n roundings must be within 5 standard errors
    (hi - lo) sqrt(p (1 - p) / n) of x. Round-to-nearest is 0.05-0.45 ulp off here: far out."""
    n = 200_000
    generator = torch.Generator().manual_seed(0)
    for lo, fraction in ((1.0, 0.3), (-3.0, 0.8), (1e-3, 0.05), (1e-30, 0.55)):
        lo_bf16 = torch.tensor(lo, dtype=torch.bfloat16)
        hi = _next_bf16(lo_bf16)
        x = lo_bf16.float() + fraction * (hi - lo_bf16.float())
        rounded = stochastic_round_bf16(x.expand(n).contiguous(), generator)
        assert set(rounded.float().unique().tolist()) <= {lo_bf16.item(), hi.item()}
        ulp = (hi - lo_bf16.float()).abs().item()
        standard_error = ulp * math.sqrt(fraction * (1 - fraction) / n)
        mean = rounded.double().mean().item()
        assert abs(mean - x.item()) <= 5 * standard_error, (lo, mean, x.item(), standard_error)


def _next_bf16(value: torch.Tensor) -> torch.Tensor:
    """The bf16 neighbour of bf16 ``value`` away from zero, as float32."""
    bits = value.view(torch.int16) + 1
    return bits.view(torch.bfloat16).float()


def test_stochastic_rounding_reproducible_from_generator_state():
    x = torch.randn(1000)
    generator = torch.Generator().manual_seed(3)
    saved = generator.get_state()
    first = stochastic_round_bf16(x, generator)
    assert not torch.equal(first, stochastic_round_bf16(x, generator))  # fresh bits each call
    generator.set_state(saved)
    assert torch.equal(first, stochastic_round_bf16(x, generator))
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 2.0])
    out = stochastic_round_bf16(special, generator).float()
    assert out[0].isnan() and out[1:].tolist() == [math.inf, -math.inf, 0.0, 2.0]


@pytest.mark.parametrize("mapping, signed", [(SIGNED, True), (UNSIGNED, False)])
def test_int8_moments_round_trip_within_the_stated_bound(mapping, signed):
    """Moments over 12 decades with an odd length (a partial last block): every element within
    ``error_bound`` (plus float32 rounding of the scale arithmetic, 1e-6 of the block max);
    the bound is tight (reached within 1%) and at most 0.8% of the block max."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g) * torch.logspace(-12, 0, 5000)
    x = x if signed else x.square()
    codes, scales = empty_codes(x.numel(), mapping, x.device)
    quantize_(x, codes, scales, mapping)
    assert codes.dtype == mapping.dtype and codes.numel() == 20 * 256 and scales.numel() == 20
    back = dequantize(codes, scales, x.numel(), x.shape, mapping)
    error, bound = (x - back).abs(), error_bound(x, mapping)
    block_max = scales.repeat_interleave(256)[:x.numel()]
    assert bool((error <= bound + 1e-6 * block_max).all())
    assert (error / bound.clamp_min(1e-38)).max() > 0.99
    assert bool((bound <= 0.008 * block_max).all())
    if not signed:
        assert bool((back >= 0).all())


def test_the_unsigned_mapping_refuses_negative_values():
    x = torch.tensor([1.0, -1e-30, 2.0])
    codes, scales = empty_codes(x.numel(), UNSIGNED, x.device)
    with pytest.raises(ValueError, match="non-negative values only"):
        quantize_(x, codes, scales, UNSIGNED)
