"""Selective recomputation inside a stage (exec/selective.py, plan/selective.py): a taped
forward that keeps only its matmul and attention outputs gives plain autograd's output and
gradients bit for bit, dropout included; its tape is smaller, as the analytic costs say; the
executor holds what the simulator predicts; the planner takes it where it is faster; and
training with it, also streamed under the simulated GPU, is plain PyTorch's."""
import copy
import time

import pytest
import torch
import transformers
from models import hf_sample, tiny_hf
from side_by_side import train_and_match
from torch import nn

import tierflow
from tierflow.chain import to_chain
from tierflow.core.config import FitConfig
from tierflow.exec.context import AutocastMode
from tierflow.exec.selective import SelectiveUnsupported, run_selective
from tierflow.exec.stage_call import (
    backward_taped,
    forward_plain,
    forward_taped,
    storage_key,
    tape_bytes,
)
from tierflow.plan import Plan
from tierflow.plan.choose import fastest_plan, make_plan
from tierflow.plan.costs import ChainCosts, SelectiveCost, StageCost
from tierflow.plan.ops import Backward, Drop, Forward
from tierflow.plan.selective import selective_costs
from tierflow.plan.simulate import simulate
from tierflow.plan.transfers import Transfers
from tierflow.plan.weight_schedule import StreamedWeights
from tierflow.sim.shapes import shape_from_config
from tierflow.sim.stages import StepShape, layer_activation_bytes

FP32 = AutocastMode("cpu", False, torch.bfloat16)
BF16 = AutocastMode("cpu", True, torch.bfloat16)
FAMILIES = ["llama", "qwen2", "gpt2"]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _layers(model, sample):
    chain = to_chain(model, sample)
    x, ctx = chain.split_inputs(**sample)
    return chain, forward_plain(chain.stages[0], x, ctx, FP32), ctx


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_selective_layer_is_plain_autograd_bit_for_bit(family, attn):
    """Each decoder layer in fp32 with dropout 0.1: run selectively, its output, input
    gradient and every weight gradient equal the whole tape's exactly (tolerance 0), though
    the RNG moved on between forward and backward; its tape is less than half."""
    model = tiny_hf(family, layers=2, dropout=0.1, attn_implementation=attn)
    chain, x, ctx = _layers(model, hf_sample(labels=False))
    held = {storage_key(p) for p in model.parameters()}
    for stage in chain.stages[1:-1]:
        runs = []
        for selective in (False, True):
            torch.manual_seed(3)
            taped = forward_taped(stage, x, ctx, FP32, input_grad=True, selective=selective)
            torch.manual_seed(11)  # the recomputation must replay the forward's draws
            grad_x = backward_taped(taped, torch.ones_like(taped.y))
            grads = [p.grad.clone() for p in stage.parameters()]
            stage.zero_grad(set_to_none=True)
            runs.append((taped.y.detach(), grad_x, grads, tape_bytes(taped, held)))
        (y, gx, grads, whole), (y_s, gx_s, grads_s, part) = runs
        assert torch.equal(y, y_s) and torch.equal(gx, gx_s)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_s))
        assert 0 < part < whole / 2
        x = y


@pytest.mark.parametrize("kv,mlp", [(64, 512), (256, 704)])
def test_analytic_selective_tape_is_a_measured_llama_layer(kv, mlp):
    """``layer_activation_bytes(selective=True)`` is what a Llama layer (SDPA, h = 256)
    keeps when run selectively, in fp32 and under bf16 autocast, within 8 bytes a token."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=mlp,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=kv // 64, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()
    sample = hf_sample(batch=2, seq=128, labels=False)
    chain, x, ctx = _layers(model, sample)
    held = {storage_key(p) for p in model.parameters()}
    shape, step = shape_from_config(config.to_dict()), StepShape(128, 2)
    for mode, regime in ((FP32, "fp32"), (BF16, "autocast")):
        taped = forward_taped(chain.stages[1], x, ctx, mode, input_grad=True, selective=True)
        measured = tape_bytes(taped, held)
        predicted = layer_activation_bytes(shape, step, regime, selective=True)
        assert abs(measured - predicted) <= 8 * step.tokens, (regime, measured, predicted)


def test_selective_refuses_offload_hooks_and_in_place_changes():
    """A selective forward's tape is the checkpoint's cache: offload hooks would never see
    it (refused); a stage that changes a kept output in place cannot run selectively."""
    stage = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    call = lambda x, ctx: stage(x)  # noqa: E731
    with pytest.raises(ValueError, match="offload hooks"):
        forward_taped(lambda x, ctx: stage(x), torch.randn(4, 8), {}, FP32, input_grad=True,
                      offload=(lambda t: t, lambda t: t), selective=True)
    with torch.enable_grad(), pytest.raises(SelectiveUnsupported):
        run_selective(call, torch.randn(4, 8, requires_grad=True), {})

class _Kept:
    """What PyTorch's caching mode wraps a kept output in: the tensor and its version then."""

    def __init__(self, val):
        self.val, self.version = val, getattr(val, "_version", None)


@pytest.mark.parametrize("layout", ["list", "dict"])
def test_the_kept_outputs_are_read_from_either_layout_of_the_forward_cache(layout):
    """Before torch 2.13 the cache holds a list of outputs per op, since then a dict by call
    index (the lent GPUs run 2.11): both give the tape's bytes, an in-place change after the
    keeping is seen, and the policy lets go of the cache once read."""
    from tierflow.exec.selective import KeepMatmuls

    kept, other, changed = torch.zeros(4, 8), torch.zeros(16), torch.zeros(2)
    calls = [(_Kept(kept), _Kept(3)), _Kept(other)]
    for changes in (False, True):
        policy = KeepMatmuls()
        wrapped = _Kept(changed)
        entries = calls + [wrapped]
        policy._cache = {"mm": entries if layout == "list" else dict(enumerate(entries))}
        if changes:
            changed.add_(1)
        assert policy.note_kept() is changes
        assert sorted(policy.saved.values()) == [8, 64, 128]
        assert policy._cache is None



def test_the_recomputation_is_timed_inside_the_backward_and_priced_by_it():
    """A selective layer's backward times its recomputation (more than nothing, less than
    the backward, which runs it); the profiler prices the selective variant's extra backward
    by that time, not by the difference of two backwards' medians (noise around zero on 2
    cores), so the planner never takes selective recomputation for free."""
    from tierflow.exec.memory import HostMeter
    from tierflow.profile import profiler

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    sample = hf_sample(batch=2, seq=256, labels=False)
    chain, x, ctx = _layers(model, sample)
    taped = forward_taped(chain.stages[1], x, ctx, FP32, input_grad=True, selective=True)
    assert taped.policy.recompute_seconds == 0.0  # nothing recomputed before the backward
    start = time.perf_counter()
    backward_taped(taped, torch.ones_like(taped.y))
    backward = time.perf_counter() - start
    assert 0.0 < taped.policy.recompute_seconds < backward

    x, ctx = chain.split_inputs(**sample)
    measuring = profiler.Measuring(HostMeter(), repeats=2, selective=True)
    costs, _ = profiler.profile_chain(chain, x, ctx, FP32, measuring)
    layers = [c for c in costs if c.selective is not None]
    assert len(layers) == 2
    for cost in layers:
        assert 0.0 < cost.selective.recompute_time < cost.fwd_time + cost.bwd_time


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_with_selective_layers_trains_as_plain_pytorch(family):
    """Every decoder layer selective (keep-all, AdamW inside the backward): 3 steps with
    dropout, the losses and every parameter as plain PyTorch's (1e-4)."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = tierflow.fit(model, sample, optimizer=_adamw,
                          config=FitConfig(planner="keep-all", selective="all"))
    assert {op.stage for op in module.plan.ops
            if isinstance(op, Forward) and op.selective} == {1, 2, 3}
    train_and_match(module, reference, [sample], _adamw)


@pytest.mark.parametrize("family,planner", [("llama", "keep-all"), ("gpt2", "checkpoint-all")])
def test_simulated_gpu_streams_selective_layers(family, planner):
    """Under the simulated GPU, every stage streamed from host RAM, kept or recomputed from
    its checkpoint, the layers' taped forwards selective: a layer's weights leave between
    that forward and its backward when other stages run between them (the tape keeps
    none), and training is plain PyTorch's."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", ram="1GiB",
                          config=FitConfig(simulated_gpu=True, stream="all", planner=planner,
                                           selective="all"))
    ops = module.plan.ops
    taped = [k for k, op in enumerate(ops) if isinstance(op, Forward) and op.selective]
    assert {ops[k].stage for k in taped} == {1, 2, 3}
    for k in taped:
        i = ops[k].stage
        backward = next(n for n in range(k, len(ops))
                        if isinstance(ops[n], Backward) and ops[n].stage == i)
        between = [op for op in ops[k + 1:backward] if isinstance(op, (Forward, Backward))]
        if between:
            assert any(isinstance(op, Drop) and op.stage == i for op in ops[k:backward])
    train_and_match(module, reference, [sample], _adamw)


def test_ledger_holds_what_the_simulator_predicts_for_selective_tapes():
    """The executor's byte ledger peaks at the simulator's resident peak with selective
    tapes (gradients and parameters left out), and that is less than with whole tapes."""
    peaks = {}
    for selective in ("never", "all"):
        model = tiny_hf("llama", layers=3, dropout=0.1)
        sample = hf_sample()
        module = tierflow.fit(model, sample, config=FitConfig(planner="keep-all",
                                                              selective=selective))
        costs = module.plan.costs
        bare = ChainCosts(tuple(StageCost(**{**s.__dict__, "param_bytes": 0})
                                for s in costs.stages), costs.input_bytes,
                          costs.context_bytes, selective=costs.selective)
        expected = max(e.resident for e in simulate(bare, module.plan.ops).timeline)
        module(**sample).loss.backward()
        assert module.ledger.peak == expected
        peaks[selective] = expected
    assert peaks["all"] < peaks["never"]


def _chain(n=4):
    """n stages of 1 s forward, 2 s backward, a 100-byte tape, or 40 bytes selectively for
    0.1 s more backward."""
    stage = StageCost("s", 1.0, 2.0, param_bytes=0, output_bytes=10, tape=100,
                      selective=SelectiveCost(40, 0.1, 0, 0))
    return ChainCosts(tuple(stage for _ in range(n)), input_bytes=10)


def test_the_planner_takes_selective_tapes_where_they_are_faster():
    """Without a budget whole tapes are faster (no recomputation); under one that whole
    tapes fit only by recomputing stages, selective tapes are; ``never`` and ``all`` force
    the choice. The plan's ops say which forwards are selective and survive JSON."""
    costs = _chain()
    auto = FitConfig()
    assert not fastest_plan(costs, None, auto).costs.selective
    budget = simulate(selective_costs(costs, range(4)), make_plan(
        selective_costs(costs, range(4)), None, auto).ops).peak
    plan = fastest_plan(costs, budget, auto)
    assert plan.costs.selective == (0, 1, 2, 3) and not plan.recomputed_stages()
    assert all(op.selective for op in plan.ops if isinstance(op, Forward))
    assert plan.predicted_time < make_plan(costs, budget, FitConfig(selective="never")
                                           ).predicted_time
    assert not fastest_plan(costs, budget, FitConfig(selective="never")).costs.selective
    assert fastest_plan(costs, None, FitConfig(selective="all")).costs.selective
    back = Plan.from_json(plan.to_json())
    assert back.ops == plan.ops and back.costs == plan.costs


def test_plans_check_selective_ops_against_their_costs():
    """A taped forward runs selectively exactly when the costs price it so."""
    costs = selective_costs(_chain(2), [1])
    whole = [Forward(0, True), Forward(1, True), Backward(1), Backward(0)]
    with pytest.raises(ValueError, match="selective"):
        Plan("keep-all", tuple(whole), costs)
    with pytest.raises(ValueError, match="without a tape"):
        Forward(0, False, True)
    Plan("keep-all", (Forward(0, True), Forward(1, True, True), Backward(1), Backward(0)),
         costs)


def test_streamed_selective_stage_drops_its_weights_until_its_backward():
    """A streamed stage's whole tape holds its weights (kept until its backward); a
    selective one does not, so they are dropped after its forward and read back."""
    costs = _chain(3)
    streamed = StreamedWeights(((0, 50, 50), (1, 50, 50), (2, 50, 50)), "ram", "gpu",
                               "copy up", "copy down", depth=0)
    for stages, dropped in (((), set()), ((0, 1, 2), {0, 1})):
        plan = make_plan(selective_costs(costs, stages), None, FitConfig())
        ops = plan.with_transfers(Transfers(weights=streamed)).ops
        last_forward = max(k for k, op in enumerate(ops) if isinstance(op, Forward))
        assert {op.stage for op in ops[:last_forward]
                if isinstance(op, Drop)} == dropped
