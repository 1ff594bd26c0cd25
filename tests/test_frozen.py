"""Fine-tuning with frozen parameters (``requires_grad=False``): every placement trains as
plain PyTorch does; the planner streams frozen weights as it streams the others, and runs the
stages before the first trainable one forward only, once, as plain autograd does."""
import copy
from dataclasses import replace

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.exec.offload import offloaded_parameters
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Backward, Forward, Free, Update
from tierflow.plan.rotor import Infeasible, rotor, smallest_budget
from tierflow.plan.simulate import check_complete, simulate
from tierflow.plan.strategies import checkpoint_all, keep_all
from tierflow.plan.streaming import streamed_costs


def _adamw(params):
    """AdamW with eps 1e-5: at torch's 1e-8, a weight whose gradient is rounding noise (GPT-2's
    layer 1 c_proj has one at 8e-9, its streamed run's 4e-10 apart, the fused head summing in
    another order) takes a step of lr * g / (|g| + eps) that differs by 1.4e-4 (the
    comparison's tolerance is 1e-4; seen on an AMX CPU, whose kernels round differently)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _frozen_copy(family: str):
    """A tiny model with dropout whose embeddings and first decoder layer are frozen (GPT-2's
    head is tied to its embedding: frozen too), and its plain-PyTorch twin."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    for name, p in model.named_parameters():
        if "embed" in name or "wte" in name or "wpe" in name or ".0." in name:
            p.requires_grad_(False)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("planner", ["keep-all", "rotor", "checkpoint-all"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_caller_optimizer_over_trainable_parameters(family, planner):
    """The caller's AdamW over the trainable parameters only, 3 steps with dropout: the
    losses and every parameter as plain PyTorch's (fp32: 1e-4)."""
    model, reference = _frozen_copy(family)
    sample = hf_sample()
    module = tierflow.fit(model, sample, config=FitConfig(planner=planner))
    ours = _adamw([p for p in model.parameters() if p.requires_grad])
    theirs = _adamw([p for p in reference.parameters() if p.requires_grad])
    for step in range(3):
        torch.manual_seed(step)
        loss = module(**sample).loss
        loss.backward()
        torch.manual_seed(step)
        expected = reference(**sample).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        assert p.grad is None or p.requires_grad, name


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])  # qwen2: a tied, frozen head
def test_streamed_from_disk_with_owned_optimizer(tmp_path, family, grad_accum, monkeypatch):
    """Every stage streamed from disk, frozen ones included, updates inside the backward or
    (3 micro-batches, clipped) after it: as plain PyTorch, and no frozen weight is ever
    written back (their files stay as first written)."""
    model, reference = _frozen_copy(family)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    module = tierflow.fit(model, samples[0], optimizer=_adamw, disk=tmp_path,
                          grad_accum=grad_accum, max_grad_norm=0.5 if grad_accum > 1 else None,
                          config=FitConfig(planner="checkpoint-all", stream="all",
                                           prefetch_depth=1))
    names = {id(p): name for name, p in module.model.named_parameters()}
    frozen_streamed = {names[id(p)] for ps in module.streamer.stage_params.values() for p in ps
                       if not p.requires_grad}
    assert frozen_streamed  # the first decoder layer's weights at least
    offloaded = module.streamer.offloaded
    written = set()  # names only: an emptied parameter must not be printed
    write_all = offloaded.write_all
    monkeypatch.setattr(offloaded, "write_all", lambda ps, *after: (
        written.update(names[id(p)] for p in ps), write_all(ps, *after))[1])
    train_and_match(module, reference, samples, _adamw)
    assert written and not written & frozen_streamed


def test_frozen_layers_profiled_from_disk_under_a_ram_budget(tmp_path):
    """With ram= and disk=, fit moves the model's weights to disk first and profiles each
    stage with its own weights alone, frozen ones included (they were left out: the profile
    read an empty weight), and trains as plain PyTorch."""
    model, reference = _frozen_copy("llama")
    sample = hf_sample()
    module = tierflow.fit(model, sample, optimizer=_adamw, ram="1GiB", disk=tmp_path)
    assert offloaded_parameters(model) is not None
    train_and_match(module, reference, [sample], _adamw)


def test_host_steps_below_a_simulated_gpu():
    """The optimizer stepped in host RAM below a simulated GPU, every stage streamed from
    there: frozen weights move like the others and take no step."""
    model, reference = _frozen_copy("llama")
    sample = hf_sample()
    module = tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", ram="1GiB",
                          config=FitConfig(simulated_gpu=True, stream="all",
                                           planner="checkpoint-all", host_updates="all"))
    train_and_match(module, reference, [sample], _adamw)


def test_plan_counts_the_frozen_weights_it_streams(tmp_path):
    """All but the last decoder layer frozen: the plan's streamed bytes are every weight the
    streamer moves, frozen ones included, and so are the bytes it frees. While streaming
    was priced by trainable bytes only, frozen weights counted as fixed, and freezing layers
    raised the smallest budget that works (124.5 MiB against 117.6 for the same Llama fully
    trainable, seq 64, batch 2) instead of lowering it."""
    model = tiny_hf("llama", layers=3)
    for name, p in model.named_parameters():
        if ".2." not in name:
            p.requires_grad_(False)
    module = tierflow.fit(model, hf_sample(), optimizer=_adamw, disk=tmp_path,
                          config=FitConfig(planner="checkpoint-all", stream="all",
                                           prefetch_depth=1))
    moved = [p for ps in module.streamer.stage_params.values() for p in ps]
    assert any(not p.requires_grad for p in moved)
    assert module.plan.costs.extra["streamed bytes"] == sum(p.nbytes for p in moved)


def test_streamed_costs_move_frozen_weights_and_write_trainable_ones():
    """Pure data: a streamed stage's read, residency and freed static bytes count its frozen
    weights; its write-back after the update only its trainable ones."""
    from schedules import streaming

    from tierflow.plan.ops import Backward, Forward, Load, Store, Update
    from tierflow.plan.timeline import timeline
    from tierflow.plan.weight_schedule import schedule_weights

    stage = StageCost(name="layer", fwd_time=1.0, bwd_time=0.0, param_bytes=100,
                      frozen_bytes=300, output_bytes=8, tape=10)
    costs = ChainCosts(stages=(stage,), input_bytes=8, static_bytes=1000, optimizer_owned=True)
    moved = streamed_costs(costs, {0}, home="disk", read_bytes_per_s=100.0,
                           write_bytes_per_s=100.0, depth=0)
    s = moved.stages[0]
    assert s.tape == 10 + 400
    assert moved.static_bytes == 1000 - 400 + 400  # moved out, one stage's buffer back
    assert moved.extra["streamed bytes"] == 400
    ops = [Forward(0, tape=True), Backward(0), Update(0)]
    schedule = schedule_weights(ops, streaming(costs, {0}, 0), 1)
    assert [op.nbytes for op in (*schedule.cold, *schedule.step)
            if isinstance(op, (Load, Store))] == [400, 100]  # kept from step to step
    spans = {span.resource: span.end - span.start
             for span in timeline(moved, schedule.step).spans}
    assert spans["disk write"] == pytest.approx(1.0)  # 100 trainable bytes written


def _prefixed_costs(owned: bool = True) -> ChainCosts:
    """Six stages of which the first three train nothing and need no input gradient (a
    frozen embedding and two frozen layers), the rest like plain trainable stages."""
    stages = tuple(StageCost(f"s{i}", fwd_time=1.0, bwd_time=2.0,
                             param_bytes=0 if i < 3 else 10, frozen_bytes=10 if i < 3 else 0,
                             output_bytes=100, tape=300, fwd_transient=5, bwd_transient=7,
                             input_grad=i > 3, needs_backward=i >= 3)
                   for i in range(6))
    return ChainCosts(stages, input_bytes=8, static_bytes=1000, optimizer_owned=owned)


@pytest.mark.parametrize("planner", ["keep-all", "checkpoint-all", "rotor"])
def test_a_forward_only_prefix_runs_once_without_tapes(planner):
    """Pure data: every planner runs the stages that need no backward once, without a tape,
    each input freed as the next exists, and backpropagates and updates only the others."""
    costs = _prefixed_costs()
    if planner == "rotor":
        ops = rotor(costs, smallest_budget(costs))
    else:
        ops = keep_all(costs) if planner == "keep-all" else checkpoint_all(costs)
    assert ops[:5] == [Forward(0, tape=False), Forward(1, tape=False), Free(1),
                       Forward(2, tape=False), Free(2)]
    assert not any(isinstance(op, Forward) and op.stage < 3 for op in ops[5:])
    assert [op.stage for op in ops if isinstance(op, Backward)] == [5, 4, 3]
    assert sorted(op.stage for op in ops if isinstance(op, Update)) == [3, 4, 5]
    check_complete(costs, ops)
    simulate(costs, ops)


def test_rotor_budget_counts_the_prefix_peak():
    """When a prefix stage's forward needs more than any schedule of the rest, the smallest
    budget is the prefix's peak, and a budget below it is infeasible."""
    costs = _prefixed_costs()
    big = replace(costs.stages[1], fwd_transient_nograd=10_000)
    costs = replace(costs, stages=(costs.stages[0], big, *costs.stages[2:]))
    least = smallest_budget(costs)
    assert least == simulate(costs, keep_all(costs)[:2]).peak > 10_000
    rotor(costs, least)
    with pytest.raises(Infeasible):
        rotor(costs, least - 1)


def test_frozen_prefix_in_a_fitted_model_runs_forward_once():
    """The embeddings and first decoder layer frozen: their stages run once a step, forward
    only (no backward, no recomputation, even under checkpoint-all), and training is still
    plain PyTorch's."""
    model, reference = _frozen_copy("llama")
    sample = hf_sample()
    module = tierflow.fit(model, sample, config=FitConfig(planner="checkpoint-all"))
    ops = module.plan.ops
    assert [op.stage for op in ops if isinstance(op, Backward)] == [4, 3, 2]  # head, layers
    assert [op for op in ops if isinstance(op, Forward) and op.stage < 2] == [
        Forward(0, tape=False), Forward(1, tape=False)]
    calls = []  # the first layer's MLP (splitting the inputs passes the layer itself by)
    model.model.layers[0].mlp.register_forward_hook(lambda *args: calls.append(1))
    torch.manual_seed(0)
    loss = module(**sample).loss
    loss.backward()
    assert len(calls) == 1
    assert "forward only, once (nothing in or before them trains): embed, layers.0" in \
        module.plan.explain()
    torch.manual_seed(0)
    expected = reference(**sample).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_input_that_requires_grad_needs_a_sample_that_did():
    """A plan made from a sample whose input needed no gradient runs its frozen first stage
    forward only; an input that requires grad is then refused with one line."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model[0].requires_grad_(False)
    module = tierflow.fit(model, torch.randn(4, 8))
    assert module.plan.ops[0] == Forward(0, tape=False)
    with pytest.raises(tierflow.TierflowError, match="give fit a sample whose input requires"):
        module(torch.randn(4, 8, requires_grad=True))


def test_a_model_with_nothing_to_train_is_refused():
    """Every parameter frozen and an input that needs no gradient: one line, as plain
    autograd's backward would fail."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.requires_grad_(False)
    with pytest.raises(tierflow.TierflowError, match="nothing to train"):
        tierflow.fit(model, torch.randn(4, 8))


@pytest.mark.parametrize("planner", ["keep-all", "rotor", "checkpoint-all"])
def test_a_sequential_model_with_frozen_first_layers(planner):
    """An nn.Sequential chain whose first two stages are frozen: they run forward only, and
    the loss and every gradient are plain PyTorch's (fp32, default tolerances)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        layer.requires_grad_(False)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    module = tierflow.fit(model, x, config=FitConfig(planner=planner))
    assert isinstance(module.plan.ops[0], Forward) and not module.plan.ops[0].tape
    torch.manual_seed(1)
    module(x).sum().backward()
    torch.manual_seed(1)
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
