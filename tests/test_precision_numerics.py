"""Precision numerics: the config's validation, JSON round trip and bytes per parameter; the
stochastic rounding's unbiasedness and reproducibility; the int8 moments' error bound; the
AdamW step's peak memory."""
import math
import os
import subprocess
import sys

import pytest
import torch

from tierflow.core.errors import TierflowError
from tierflow.precision import PrecisionConfig, PrecisionError, stochastic_round_bf16
from tierflow.precision.adamw import CHUNK
from tierflow.precision.quant import (
    SIGNED,
    UNSIGNED,
    dequantize,
    empty_codes,
    error_bound,
    quantize_,
)

MIB = 2 ** 20


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
        PrecisionConfig(**fields).validate()
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_fp8_without_scaled_mm_is_one_line(monkeypatch):
    from tierflow.precision import apply

    apply._runs.cache_clear()
    monkeypatch.delattr(torch, "_scaled_mm")
    try:
        with pytest.raises(PrecisionError) as info:
            apply.check_device(PrecisionConfig(matmul_dtype="fp8"), "cpu")
    finally:
        apply._runs.cache_clear()  # the next probe sees the real torch again
    assert "\n" not in str(info.value) and "torch._scaled_mm" in str(info.value)
    apply.check_device(PrecisionConfig(matmul_dtype="bf16"), "cpu")


def test_the_record_imports_no_torch():
    """The simulator and the command line read the precision record without torch."""
    import subprocess
    import sys
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "src"
    code = ("import sys; sys.path.insert(0, %r); import tierflow.precision.config, "
            "tierflow.sim.options, tierflow.train.options; "
            "assert 'torch' not in sys.modules, 'torch was imported'" % str(src))
    subprocess.run([sys.executable, "-c", code], check=True)


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
    # NaNs whose payload the added noise could turn into inf or carry into the sign bit
    nans = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32)
    special = torch.cat([nans.view(torch.float32).expand(64, 4).reshape(-1),
                         torch.tensor([math.inf, -math.inf, 0.0, 2.0])])
    into = torch.empty(special.shape, dtype=torch.bfloat16)
    out = stochastic_round_bf16(special, generator, out=into)
    assert out is into
    assert bool(out[:256].isnan().all()) and out[256:].tolist() == [math.inf, -math.inf, 0, 2]


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


_STEP_PEAK_SCRIPT = """
import torch
from pathlib import Path
from tierflow.profile.machine import reset_peak_rss
from tierflow.precision.adamw import AdamW, CHUNK
dtype = torch.bfloat16 if "{model_dtype}" == "bf16" else torch.float32
p = torch.nn.Parameter(torch.randn(2 * CHUNK, dtype=dtype))
p.grad = torch.randn_like(p)
optimizer = AdamW([p], moment_dtype="{optim_dtype}", master="{master}", seed=0)
def status_kib(field):
    line = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field)]
    return int(line[0].split()[1])
optimizer.step(); optimizer.step()  # the states exist and malloc has seen a step
growth = []
for _ in range(3):
    before = status_kib("VmRSS")
    reset_peak_rss()
    optimizer.step()
    growth.append(status_kib("VmHWM") - before)
print(max(growth) * 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.parametrize("model_dtype, optim_dtype, master, vectors", [
    ("fp32", "int8", "fp32", 3), ("fp32", "bf16", "fp32", 3),
    ("bf16", "int8", "fp32", 4), ("bf16", "bf16", "none", 5)])
def test_adamw_steps_within_its_workspace(model_dtype, optim_dtype, master, vectors):
    """A step's peak RSS (the kernel's high-water mark, in a fresh process) grows by its
    workspace of float32 slices of CHUNK elements and nothing more: int8 decoding reads the
    codes' signs from the workspace and stochastic rounding writes into the state, where an
    op mixing int8 and float32 copied the codes as floats (16 MiB more) and the rounding
    allocated a mask and a bf16 slice (16 MiB more)."""
    script = _STEP_PEAK_SCRIPT.format(model_dtype=model_dtype, optim_dtype=optim_dtype,
                                      master=master)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    workspace = vectors * 4 * CHUNK
    assert int(out.split()[-1]) <= workspace + 2 * MIB, (out, workspace)


def _reference_hash32(index: int, seed: int) -> int:
    """The hash as unsigned 32-bit arithmetic in Python integers."""
    mask = 0xFFFFFFFF
    x = (index ^ seed) & mask
    x ^= x >> 16
    x = (x * 0x7FEB352D) & mask
    x ^= x >> 15
    x = (x * 0x5BD1E995) & mask
    return x ^ (x >> 16)


@pytest.mark.parametrize("seed", [7, (1 << 31) + 3, (1 << 32) - 1])
def test_the_int32_hash_has_the_bits_of_unsigned_arithmetic(seed):
    """``hash32`` computes in int32 (products wrap, shifts masked): its bits are those of
    unsigned 32-bit arithmetic, for indices past 2^31 and 2^32 and seeds past 2^31, given as
    an int or as an int64 tensor, eager and compiled alike."""
    from tierflow.precision.rounding import hash32

    picks = [0, 1, 2, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             (1 << 40) + 12345]
    picks += torch.randint(0, 1 << 62, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    index = torch.tensor(picks, dtype=torch.int64)
    want = torch.tensor([_reference_hash32(i, seed) for i in picks], dtype=torch.int64)
    for given in (seed, torch.tensor(seed, dtype=torch.int64)):
        got = hash32(index, given)
        assert got.dtype == torch.int32
        assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)
    compiled = torch.compile(hash32, dynamic=True)
    assert torch.equal(compiled(index, torch.tensor(seed, dtype=torch.int64)).to(torch.int64)
                       & 0xFFFFFFFF, want)


def test_noise_is_a_function_of_seed_and_index_on_any_number_of_cores():
    """The noise of an element depends on the seed and its index alone: a vector rounded in
    slices, each with its offset, equals the vector rounded whole, on one core or two;
    neighbouring slices are not copies of each other, and every value is in [0, 2^16)."""
    from tierflow.precision.rounding import HASH_SLICE, noise16

    n = 3 * HASH_SLICE + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    rounded = []
    try:
        for cores in (1, 2):
            torch.set_num_threads(cores)
            rounded.append(stochastic_round_bf16(x, 7))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rounded[0], rounded[1])
    cut = HASH_SLICE + 123
    pieces = torch.cat([stochastic_round_bf16(x[:cut], 7),
                        stochastic_round_bf16(x[cut:], 7, offset=cut)])
    assert torch.equal(pieces, rounded[0])
    noise = noise16(torch.arange(n), 7)
    assert not torch.equal(noise[:1000], noise[HASH_SLICE:HASH_SLICE + 1000])
    assert int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    assert abs(noise.double().mean().item() / (1 << 16) - 0.5) < 0.01
    high = noise16(torch.arange(n), 7, half=1)  # the hash's other 16 bits: another rounding's
    assert int(high.min()) >= 0 and int(high.max()) < 1 << 16 and not torch.equal(high, noise)
    assert abs(high.double().mean().item() / (1 << 16) - 0.5) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([noise.double(), high.double()]))[0, 1])) < 0.02
