"""tierflow.precision.AdamW against torch.optim.AdamW: equal in fp32, the same master
trajectory for bf16 weights, close with bf16/int8 moments, unbiased without a master; states
really stored small; save (safetensors + JSON, as the trainer does) / load / continue equals an
uninterrupted run bit for bit."""
import json
import math

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tierflow.precision import AdamW, PrecisionConfig, make_optimizer
from tierflow.train.codec import flatten_optimizer_states, unflatten_optimizer_states

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 40), (40,), (3, 7, 5)]  # a partial int8 block in each
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _groups(params):
    """The trainer's grouping: decay on matrices only."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    scales = torch.logspace(-3, 0, len(params))  # gradients of different magnitudes
    return [(torch.randn(p.shape, generator=g) * s).to(p.dtype) for p, s in zip(params, scales)]


def _run(optimizer, params, steps, first=0):
    for step in range(first, first + steps):
        for p, grad in zip(params, _grads(params, step)):
            p.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fp32_equals_torch_adamw():
    ours, theirs = _params(), _params()
    _run(AdamW(_groups(ours), **HYPER), ours, 5)
    _run(torch.optim.AdamW(_groups(theirs), **HYPER), theirs, 5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_bf16_weights_follow_the_fp32_master():
    """The master copy takes exactly torch.optim.AdamW's steps on fp32 weights fed the same
    (bf16) gradients; the bf16 weights are the master rounded to nearest."""
    weights = _params(torch.bfloat16)
    reference = [torch.nn.Parameter(p.detach().float()) for p in weights]
    optimizer = AdamW(_groups(weights), **HYPER, master="fp32")
    plain = torch.optim.AdamW(_groups(reference), **HYPER)
    for step in range(5):
        for p, q, grad in zip(weights, reference, _grads(weights, step)):
            p.grad, q.grad = grad, grad.float()
        optimizer.step()
        plain.step()
    for p, q in zip(weights, reference):
        master = optimizer.state[p]["master"]
        torch.testing.assert_close(master, q.detach())
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("moment_dtype, tolerance", [("bf16", 0.01), ("int8", 0.03)])
def test_small_moments_stay_close_to_fp32(moment_dtype, tolerance):
    """After 20 steps, the total update of every tensor is within ``tolerance`` (relative,
    Frobenius norm) of torch.optim.AdamW's (measured: bf16 0.3%, int8 1.1%)."""
    ours, theirs = _params(), _params()
    start = [p.detach().clone() for p in ours]
    _run(AdamW(_groups(ours), **HYPER, moment_dtype=moment_dtype, seed=0), ours, 20)
    _run(torch.optim.AdamW(_groups(theirs), **HYPER), theirs, 20)
    for a, b, s in zip(ours, theirs, start):
        expected = b.detach() - s
        assert (a.detach() - s - expected).norm() <= tolerance * expected.norm()


def test_updates_without_master_are_unbiased():
    """100k bf16 weights at 1.0, one Adam step of lr=1e-3 (a quarter of a bf16 ulp below 1.0,
    2^-8): round-to-nearest would lose it; with stochastic rounding the mean weight is 1 - 1e-3
    within 5 standard errors 2^-8 sqrt(p (1 - p) / n), p = 1e-3 / 2^-8."""
    n, lr, ulp = 100_000, 1e-3, 2.0 ** -8
    weight = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    optimizer = AdamW([weight], lr=lr, weight_decay=0.0, master="none", seed=0)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    p = lr / ulp
    standard_error = ulp * math.sqrt(p * (1 - p) / n)
    assert abs(weight.double().mean().item() - (1 - lr)) <= 5 * standard_error


@pytest.mark.parametrize("optim_dtype, master, expected", [
    ("fp32", "fp32", 4 + 4 + 4), ("bf16", "none", 2 + 2), ("int8", "none", 1 + 1 + 8 / 256),
    ("int8", "fp32", 4 + 1 + 1 + 8 / 256)])
def test_states_are_stored_in_the_small_dtype(optim_dtype, master, expected):
    """Optimizer state bytes of bf16 weights (1024 x 256: whole int8 blocks) equal what
    ``bytes_per_parameter`` promises the planner."""
    weight = torch.nn.Parameter(torch.zeros(1024, 256, dtype=torch.bfloat16))
    config = PrecisionConfig(model_dtype="bf16", master=master, optim_dtype=optim_dtype,
                             matmul_dtype="bf16")
    optimizer = make_optimizer([weight], config, lr=1e-3)
    weight.grad = torch.full_like(weight, 1e-3)
    optimizer.step()
    state_bytes = sum(t.nbytes for t in optimizer.state[weight].values()
                      if isinstance(t, torch.Tensor))
    assert state_bytes == expected * weight.numel()
    assert state_bytes == config.bytes_per_parameter().optimizer_state * weight.numel()


def _through_checkpoint(state: dict) -> dict:
    """``state`` stored as the trainer stores it: safetensors bytes + JSON structure (both
    refuse anything but tensors, numbers, strings, lists, tuples and dicts)."""
    tensors, structure = flatten_optimizer_states([state])
    loaded = load_safetensors(save_safetensors({k: v.contiguous() for k, v in tensors.items()}))
    return unflatten_optimizer_states(loaded, json.loads(json.dumps(structure)))[0]


@pytest.mark.parametrize("model_dtype, master, optim_dtype", [
    ("fp32", "fp32", "fp32"), ("bf16", "fp32", "int8"), ("bf16", "none", "bf16"),
    ("bf16", "none", "int8")])
def test_save_load_continue_equals_uninterrupted(model_dtype, master, optim_dtype):
    dtype = torch.float32 if model_dtype == "fp32" else torch.bfloat16
    config = PrecisionConfig(model_dtype=model_dtype, master=master, optim_dtype=optim_dtype,
                             matmul_dtype="fp32" if model_dtype == "fp32" else "bf16")
    straight = _params(dtype)
    optimizer = make_optimizer(_groups(straight), config, **HYPER, seed=1)
    _run(optimizer, straight, 6)

    first = _params(dtype)
    interrupted = make_optimizer(_groups(first), config, **HYPER, seed=1)
    _run(interrupted, first, 3)
    saved = _through_checkpoint(interrupted.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = make_optimizer(_groups(resumed_params), config, **HYPER, seed=2)  # other seed
    resumed.load_state_dict(saved)
    _run(resumed, resumed_params, 3, first=3)
    for a, b in zip(straight, resumed_params):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(straight, resumed_params):
        mine, theirs = optimizer.state[a], resumed.state[b]
        assert mine.keys() == theirs.keys()
        for key in mine:
            if isinstance(mine[key], torch.Tensor):
                assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key])
            else:
                assert mine[key] == theirs[key]


def test_a_step_gathered_as_a_tensor_loads_as_an_int():
    """A state gathered from ZeRO shards (tierflow.distributed) carries ``step`` as a float64
    tensor; loading it gives the int step and the same next update as the state as saved."""
    ours, other = _params(), _params()
    optimizer = AdamW(_groups(ours), **HYPER)
    _run(optimizer, ours, 3)
    state = optimizer.state_dict()
    gathered = {**state, "state": {i: {**s, "step": torch.tensor(float(s["step"]),
                                                                  dtype=torch.float64)}
                                   for i, s in state["state"].items()}}
    for a, b in zip(other, ours):
        a.data.copy_(b)
    loaded = AdamW(_groups(other), **HYPER)
    loaded.load_state_dict(gathered)
    assert all(type(s["step"]) is int and s["step"] == 3 for s in loaded.state.values())
    _run(optimizer, ours, 1, first=3)
    _run(loaded, other, 1, first=3)
    assert all(torch.equal(a, b) for a, b in zip(ours, other))


@pytest.mark.parametrize("model_dtype, master, optim_dtype", [
    ("fp32", "fp32", "fp32"), ("fp32", "fp32", "int8"), ("bf16", "fp32", "int8"),
    ("fp32", "fp32", "bf16"), ("bf16", "none", "bf16")])
def test_slices_update_like_one_pass(monkeypatch, model_dtype, master, optim_dtype):
    """A parameter updated CHUNK elements at a time (here 256: the 48 x 40 matrix takes 8
    slices, the last one partial) ends bit-equal to one pass over it, its stochastic
    roundings included (each slice hashes its own elements' indices)."""
    from tierflow.precision import adamw as adamw_module
    dtype = torch.float32 if model_dtype == "fp32" else torch.bfloat16
    config = PrecisionConfig(model_dtype=model_dtype, master=master, optim_dtype=optim_dtype,
                             matmul_dtype="bf16")
    whole, sliced = _params(dtype), _params(dtype)
    _run(make_optimizer(_groups(whole), config, seed=5, **HYPER), whole, 4)
    monkeypatch.setattr(adamw_module, "CHUNK", 256)
    _run(make_optimizer(_groups(sliced), config, seed=5, **HYPER), sliced, 4)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


@pytest.mark.parametrize("model_dtype,master,optim_dtype", [
    ("bf16", "none", "bf16"), ("fp32", "fp32", "fp32"), ("bf16", "fp32", "fp32"),
    ("bf16", "fp32", "bf16"), ("fp32", "fp32", "bf16"), ("bf16", "none", "fp32")])
def test_the_fused_kernel_steps_as_the_element_wise_operations(monkeypatch, model_dtype, master,
                                                               optim_dtype):
    """Each storage the compiled one-pass kernel takes (``fused_adamw.py``, forced here
    below its size thresholds), stepped by it and by the unfused slices from the same seed:
    3 steps leave the weights, the master and both moments equal but for float32 rounding
    order: float32 ones within a few ulps, bf16 ones a few elements one bf16 ulp apart (the
    kernel may fuse a multiply and an add, which can move a rounding across a boundary)."""
    from tierflow.precision import adamw as adamw_module
    from tierflow.precision import fused_adamw

    dtype = torch.float32 if model_dtype == "fp32" else torch.bfloat16
    config = PrecisionConfig(model_dtype=model_dtype, master=master, optim_dtype=optim_dtype,
                             matmul_dtype="bf16")
    unfused, fused = _params(dtype), _params(dtype)
    first = make_optimizer(_groups(unfused), config, seed=11, **HYPER)
    _run(first, unfused, 3)
    monkeypatch.setattr(adamw_module, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(adamw_module, "FUSED_MIN_ELEMENTS_EXACT", 0)
    stepped = []  # the parameters the kernel stepped
    monkeypatch.setattr(adamw_module, "fused_step",
                        lambda *a: stepped.append(a[0].numel()) or fused_adamw.fused_step(*a))
    second = make_optimizer(_groups(fused), config, seed=11, **HYPER)
    _run(second, fused, 3)
    assert sorted(stepped) == sorted(p.numel() for p in fused for _ in range(3))
    assert fused_adamw._compiled[0] is not None
    keys = ["exp_avg", "exp_avg_sq"] + (["master"] if "master" in first.state[unfused[0]] else [])
    pairs = [(a, b) for a, b in zip(unfused, fused)]
    pairs += [(first.state[a][key], second.state[b][key]) for a, b in zip(unfused, fused)
              for key in keys]
    for a, b in pairs:
        assert a.dtype == b.dtype
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            continue
        apart = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.01


def test_a_kernel_that_cannot_be_compiled_leaves_the_unfused_step(monkeypatch):
    """Where the fused kernel cannot be compiled (``fused_step`` returns False), the step
    runs the unfused slices for those parameters: the same weights as an optimizer that
    never tried the kernel."""
    from tierflow.precision import adamw as adamw_module

    config = PrecisionConfig(model_dtype="bf16", master="none", optim_dtype="bf16",
                             matmul_dtype="bf16")
    unfused, fallen_back = _params(torch.bfloat16), _params(torch.bfloat16)
    _run(make_optimizer(_groups(unfused), config, seed=3, **HYPER), unfused, 2)
    monkeypatch.setattr(adamw_module, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(adamw_module, "FUSED_MIN_ELEMENTS_EXACT", 0)
    tried = []
    monkeypatch.setattr(adamw_module, "fused_step", lambda *a: tried.append(1) and False)
    _run(make_optimizer(_groups(fallen_back), config, seed=3, **HYPER), fallen_back, 2)
    assert tried and all(torch.equal(a, b) for a, b in zip(unfused, fallen_back))


def test_a_kernel_whose_compiler_fails_says_so_once_and_returns_false(monkeypatch):
    """``fused_step`` where the compiler fails: False, nothing changed, one warning that
    begins with ``UNFUSED`` (which the GPU check looks for in the trainer's output), and no
    second try."""
    from torch._dynamo.exc import BackendCompilerFailed

    from tierflow.precision import fused_adamw

    calls = []

    def failing(*args):
        calls.append(1)
        raise BackendCompilerFailed(lambda: None, RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(fused_adamw, "_compiled", [failing])
    weights = torch.ones(8, dtype=torch.bfloat16)
    moments = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(2)]
    args = (weights, torch.ones(8), *moments, None, torch.zeros(2, dtype=torch.int64),
            fused_adamw.hyper_parameters(1e-3, (0.9, 0.999), 1e-8, 0.0, 1))
    with pytest.warns(UserWarning) as warned:
        assert fused_adamw.fused_step(*args) is False
    assert len(warned) == 1 and str(warned[0].message).startswith(fused_adamw.UNFUSED)
    assert torch.equal(weights, torch.ones(8, dtype=torch.bfloat16))
    assert fused_adamw.kernel_unavailable()
    assert fused_adamw.fused_step(*args) is False and calls == [1]


def test_a_step_under_a_tensor_ledger_leaves_the_kernel_compiled():
    """The optimizer probe counts one step's tensors under a dispatch mode
    (``TensorLedger``); that step runs unfused, and the steps after it keep the compiled
    kernel's speed (called under the mode, it ran operation by operation from then on: 28x
    slower for 1M elements, and the host AdamW's price in every plan with it)."""
    import time

    from tierflow.profile.tensor_ledger import TensorLedger

    weight = torch.nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16))
    weight.grad = torch.full_like(weight, 1e-3)
    optimizer = AdamW([weight], lr=1e-4, moment_dtype="bf16", master="none")

    def fastest_step() -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return min(times)

    optimizer.step()  # compiles
    before = fastest_step()
    with TensorLedger("cpu"):
        optimizer.step()
    assert fastest_step() < 4 * before


def test_a_generator_on_another_device_is_one_clear_error():
    """A shared stochastic-rounding generator must be on the parameters' device (a stage
    stepped in host RAM below a GPU cannot draw from the GPU's): one line naming both. (A
    stand-in carries the other device: this machine can make no CUDA generator.)"""
    from types import SimpleNamespace

    from tierflow.precision.config import PrecisionError

    weight = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(PrecisionError, match="generator is on cuda, the parameters on cpu"):
        AdamW([weight], moment_dtype="bf16", generator=SimpleNamespace(device=torch.device("cuda")))
    assert PrecisionConfig(optim_dtype="bf16").rounds_stochastically
    assert PrecisionConfig(model_dtype="bf16", master="none").rounds_stochastically
    assert not PrecisionConfig(model_dtype="bf16").rounds_stochastically


def test_the_optimizer_probe_prices_exact_storages_unfused():
    """The probe's larger step (``4 * PROBE_NUMEL[1]`` elements) runs below the exact
    kernel's threshold, so one rate prices every stage at or above what it takes: a stage
    too small for the kernel is never priced at the kernel's speed."""
    from tierflow.precision.fused_adamw import FUSED_MIN_ELEMENTS_EXACT
    from tierflow.profile.optimizer_probe import PROBE_NUMEL

    assert 4 * PROBE_NUMEL[1] < FUSED_MIN_ELEMENTS_EXACT
