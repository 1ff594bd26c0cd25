"""fit() against plain PyTorch: for every chain source and every planner, in fp32, the loss,
the output and every parameter gradient match (torch.testing.assert_close defaults), dropout
included; owned optimizers give the same parameters as a plain optimizer loop."""
import copy
from dataclasses import replace

import pytest
import torch
from models import (
    CORE_FAMILIES,
    hf_config,
    hf_sample,
    mlp_sample,
    residual_mlp,
    resnet_cnn,
    resnet_sample,
    sequential_mlp,
    tiny_hf,
)
from side_by_side import train_side_by_side

import tierflow
from tierflow.core.config import FitConfig
from tierflow.exec.file_io import ALIGN
from tierflow.plan import Plan
from tierflow.plan.rotor import rotor, smallest_budget
from tierflow.plan.simulate import simulate
from tierflow.plan.strategies import keep_all

PLANNERS = ("keep-all", "checkpoint-all", "rotor-mid", "rotor-min")


def _sources():
    """(id, model builder, call args, call kwargs, loss of the output)."""
    square = lambda out: out.float().square().mean()  # noqa: E731 - a loss computed by the caller
    yield "sequential", lambda: sequential_mlp(dropout=0.2), (mlp_sample(),), {}, square
    yield "fx-resmlp", lambda: residual_mlp(dropout=0.2), (mlp_sample(),), {}, square
    yield "fx-resnet", lambda: resnet_cnn(dropout=0.2), (resnet_sample(),), {}, square
    for family in CORE_FAMILIES:
        yield (f"hf-{family}", lambda f=family: tiny_hf(f, layers=3, dropout=0.1), (),
               hf_sample(), lambda out: out.loss)


SOURCES = list(_sources())


def _fit(model, args, kwargs, planner, **options):
    """fit() with ``planner``; for rotor, a budget between its smallest and keep-all's peak.

    Tiny test models have transients (measured as RSS) and gradients that dwarf their
    activations, so the rotor plans here are made from the profiled costs with those left
    out: what is tested is that rotor's schedules run exactly, whatever budget made them.
    """
    sample = kwargs if kwargs else (args if len(args) > 1 else args[0])
    if not planner.startswith("rotor"):
        return tierflow.fit(model, sample, planner=planner, **options)
    module = tierflow.fit(model, sample, planner="keep-all", **options)
    costs = module.plan.costs
    costs = replace(costs, stages=tuple(replace(s, fwd_transient=0, fwd_transient_nograd=0,
                                                bwd_transient=0, update_transient=0,
                                                param_bytes=0)
                                        for s in costs.stages))
    low = smallest_budget(costs)
    high = simulate(costs, keep_all(costs)).peak
    activations = low if planner == "rotor-min" else (low + high) // 2
    ops = rotor(costs, activations, slots=None)
    return module.with_plan(Plan("rotor", tuple(ops), costs, costs.static_bytes + activations))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("source", SOURCES, ids=[s[0] for s in SOURCES])
def test_same_loss_and_gradients_as_pytorch(source, planner):
    _, build, args, kwargs, loss_of = source
    model = build()
    reference = copy.deepcopy(model)
    module = _fit(model, args, kwargs, planner)
    if planner.startswith("rotor"):
        assert module.plan.strategy == "rotor"
        assert module.plan.predicted_peak <= module.plan.budget
    if planner == "checkpoint-all" or planner == "rotor-min":
        assert module.plan.recomputed_stages(), "this plan should recompute something"
    for step_seed in (1, 2):  # two steps: RNG and state carry over correctly
        torch.manual_seed(step_seed)
        expected = loss_of(reference(*args, **kwargs))
        expected.backward()
        after_plain = torch.rand(1)
        torch.manual_seed(step_seed)
        loss = loss_of(module(*args, **kwargs))
        loss.backward()
        after_tierflow = torch.rand(1)
        torch.testing.assert_close(loss, expected)
        got, want = _grads(model), _grads(reference)
        assert got.keys() == want.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(after_plain, after_tierflow), "recomputation moved the RNG stream"
        for (name, b), rb in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, rb, msg=lambda m, n=name: f"buffer {n}: {m}")
    assert module.ledger.peak > 0


def test_owned_optimizer_matches_plain_adamw():
    model = tiny_hf("llama", layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    module = _fit(model, (), sample, "rotor-min", optimizer=make)
    train_side_by_side(module, reference, sample, make)
    # gradients agree to fp32 rounding (see above); Adam divides by sqrt(v), which turns a
    # rounding difference on a near-zero gradient into up to lr-sized steps: atol = lr / 100
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        assert p.grad is None, f"{name}: an owned optimizer frees gradients after its update"


def test_parameters_are_the_models_own():
    model = sequential_mlp()
    module = tierflow.fit(model, mlp_sample())
    assert [id(p) for p in module.parameters()] == [id(p) for p in model.parameters()]


def test_no_grad_call_runs_plainly():
    model = tiny_hf("gpt2", layers=2)
    sample = hf_sample()
    module = tierflow.fit(model, sample, planner="checkpoint-all")
    with torch.no_grad():
        torch.testing.assert_close(module(**sample).loss, model(**sample).loss)


def test_bad_budget_strings():
    model = sequential_mlp()
    with pytest.raises(ValueError, match="unknown unit"):
        tierflow.fit(model, mlp_sample(), ram="2 parsecs")
    with pytest.raises(tierflow.BudgetError, match="at least") as error:
        tierflow.fit(model, mlp_sample(), ram=1000)
    # what a new process may need beside this one's smallest: 2% and 4 MiB more, in MiB
    smallest = error.value.smallest
    assert smallest * 1.02 + (4 << 20) <= error.value.to_give < smallest * 1.02 + (5 << 20)
    assert str(error.value).endswith(
        f'there give ram="{error.value.to_give >> 20}MiB" or more')
    assert "\n" not in str(error.value)


def test_optimizer_states_on_disk_match_plain_adamw(tmp_path):
    """A budget that cannot hold the AdamW states beside the rest puts them on disk; the
    parameters still follow plain AdamW, and the disk tier's files hold the states. (Whole
    tapes: selective ones would make room for the states in memory.) The budget is a tenth of
    the states under the least memory any plan without a disk needs; the model is wide
    enough that this is far more than the tens of KiB the runtime's measured bytes vary by
    from one fit to the next (at the tiny models' width, 354 KiB of states, it was not)."""
    import transformers

    config = hf_config("gpt2", layers=3, dropout=0.1)
    config.n_embd = 128
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    sample = hf_sample()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    whole = FitConfig(selective="never")
    tierflow.fit(model, sample, optimizer=make)  # warm: the runtime's first-use bytes are paid
    states = tierflow.fit(model, sample, optimizer=make, config=whole).plan.costs.extra[
        "optimizer states"]
    with pytest.raises(tierflow.BudgetError) as least:
        tierflow.fit(model, sample, optimizer=make, ram=4096, config=whole)
    budget = least.value.smallest - states // 10
    with pytest.raises(tierflow.BudgetError):
        tierflow.fit(model, sample, optimizer=make, ram=budget, config=whole)
    module = tierflow.fit(model, sample, optimizer=make, ram=budget, disk=tmp_path,
                          config=whole)
    assert module.plan.costs.extra["optimizer states on disk"] == states
    assert module.plan.predicted_peak <= budget
    # at this width the fused LM head's other summation order moves the later losses by
    # ~1e-6 through Adam at this lr (see train_side_by_side; ~1e-5 at lr 1e-2, and one
    # weight of 49,152 by 1.3e-4)
    train_side_by_side(module, reference, sample, make, rtol_after_update=1e-4)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)
    module.optimizer.wait()  # state writes run on an I/O thread
    if module.streamer is not None:  # the plan may stream weights from the same tier too
        module.streamer.wait_writes()
    files = {f.name: f.stat().st_size for f in tmp_path.glob("*.bin")}
    assert module.optimizer.disk.bytes == sum(files.values())
    on_disk = sum(n for name, n in files.items() if name.startswith("optimizer-"))
    moments = 2 * len(list(model.parameters()))  # direct files pad each to a block
    assert states <= on_disk < states + ALIGN * moments


def test_disk_directory_errors(tmp_path):
    model = sequential_mlp()
    make = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
    with pytest.raises(tierflow.TierflowError, match="does not exist"):
        tierflow.fit(model, mlp_sample(), optimizer=make, disk=tmp_path / "missing")
    with pytest.raises(tierflow.TierflowError, match="pass optimizer="):
        tierflow.fit(model, mlp_sample(), disk=tmp_path)


def test_a_gpu_budget_for_a_cpu_model_and_sample_is_one_clear_error():
    """gpu= with the model and the sample on the CPU names the three ways out (a GPU sample,
    ram=, a simulated GPU), and the model is left as it was."""
    model = sequential_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(tierflow.TierflowError, match="give the sample on the GPU"):
        tierflow.fit(model, mlp_sample(), gpu="1GiB")
    for p, q in zip(model.parameters(), before):
        assert p.device.type == "cpu" and torch.equal(p, q)


def test_accumulated_gradients_are_planned_as_static():
    """grad_accum=2 without an owned optimizer: the gradients the caller accumulates are
    static bytes of the plan (they live through the next micro-batch's forward), and two
    micro-batches give plain PyTorch's accumulated gradients."""
    model = tiny_hf("llama", layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(2)]
    single = tierflow.fit(copy.deepcopy(model), samples[0], planner="keep-all")
    module = tierflow.fit(model, samples[0], planner="keep-all", grad_accum=2)
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    assert module.plan.costs.grads_resident and not single.plan.costs.grads_resident
    assert module.plan.costs.extra["gradients"] == grads
    static, runtime = module.plan.costs.static_bytes, module.plan.costs.extra["runtime"]
    assert static - runtime == single.plan.costs.static_bytes - single.plan.costs.extra[
        "runtime"] + grads
    for k, sample in enumerate(samples):
        torch.manual_seed(k)
        (module(**sample).loss / 2).backward()
        torch.manual_seed(k)
        (reference(**sample).loss / 2).backward()
    expected = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("source", [SOURCES[0], SOURCES[3]], ids=[SOURCES[0][0], SOURCES[3][0]])
def test_ledger_holds_exactly_what_the_simulator_predicts(source, planner):
    """The executor's byte ledger (activations, tapes, input gradients it holds) peaks at
    the simulator's resident peak, byte for byte, once parameter gradients are left out."""
    _, build, args, kwargs, loss_of = source
    model = build()
    module = _fit(model, args, kwargs, planner)
    costs = module.plan.costs
    bare = replace(costs, static_bytes=0, shared_grad_bytes=0,
                   stages=tuple(replace(s, param_bytes=0) for s in costs.stages))
    expected = max(event.resident for event in simulate(bare, module.plan.ops).timeline)
    loss_of(module(*args, **kwargs)).backward()
    assert module.ledger.peak == expected
