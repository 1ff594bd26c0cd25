"""Data parallelism in the plan: ``TierflowModule.reduce_gradients_with`` (an optimizer tierflow
owns) and ``run_collectives_with`` (ZeRO-2's shards, their gathers after the step).
The plan gains a Reduce op after each stage's backward; each stage's gradients go to the
reduction once complete for the step (last stage first, only on the last micro-batch), before
the clipping norm, the disk tier and the update see them."""
import copy

import pytest
import torch
from models import hf_sample, tiny_hf

import tierflow
from tierflow import FitConfig
from tierflow.core.errors import TierflowError
from tierflow.plan.ops import Backward, Reduce, Update
from tierflow.plan.reductions import (
    GRADIENT_NORM,
    LOSS,
    MEMORY_REPORT,
    Reductions,
    step_values,
)

TWO = Reductions(2, all_reduce=True, bus=1e9)  # two workers, 1 GB/s bus


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("family, grad_accum, clip, disk", [
    ("llama", 1, None, False),  # updates inside the backward
    ("llama", 2, 1.0, False),  # one pass after the last micro-batch, clipped
    ("llama", 2, 1.0, True),  # the same, every stage streamed: gradients wait on disk
    ("qwen2", 1, None, False),  # the head tied to the embedding: reduced once
])
def test_the_update_sees_the_reduced_gradients(family, grad_accum, clip, disk, tmp_path):
    """A reduction that halves every gradient, as averaging over two workers whose other
    one saw zero gradients would: the weights then move as plain PyTorch's with the
    gradients halved (the clipping norm measured after the halving)."""
    model = tiny_hf(family, layers=2)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    extra = dict(disk=str(tmp_path), config=FitConfig(stream="all")) if disk else {}
    module = tierflow.fit(model, samples[0], optimizer=_sgd, grad_accum=grad_accum,
                          max_grad_norm=clip, **extra)
    calls: list[list[int]] = []

    def halve(grads: list[torch.Tensor]) -> None:
        calls[-1].append(len(grads))
        for g in grads:
            g.mul_(0.5)
    module.reduce_gradients_with(halve, TWO)
    plain = _sgd(reference.parameters())
    for step in range(2):
        for k, sample in enumerate(samples):
            calls.append([])
            (module(**sample).loss / grad_accum).backward()
            (reference(**sample).loss / grad_accum).backward()
            assert bool(calls[-1]) == (k == grad_accum - 1)  # none before the last
        for p in reference.parameters():
            p.grad.mul_(0.5)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(reference.parameters()), clip)
        plain.step()
        plain.zero_grad(set_to_none=True)
    module.settle()
    assert sum(calls[-1]) == len(list(model.parameters()))  # every gradient, once
    for (name, p), q in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_stages_are_reduced_last_first():
    model = tiny_hf("llama", layers=3)
    module = tierflow.fit(model, hf_sample(), optimizer=_sgd)
    stages = module.optimizer.stage_params
    order: list[int] = []
    module.reduce_gradients_with(lambda grads: order.append(next(
        i for i, ps in enumerate(stages) if any(p.grad is grads[0] for p in ps))), TWO)
    module(**hf_sample()).loss.backward()
    assert order == [i for i in reversed(range(len(stages))) if stages[i]]


def test_without_an_owned_optimizer_it_is_refused():
    module = tierflow.fit(tiny_hf("llama"), hf_sample())
    with pytest.raises(TierflowError, match="with your own, average the gradients"):
        module.reduce_gradients_with(lambda grads: None, TWO)


def test_each_reduce_comes_between_its_backward_and_its_update_and_is_priced():
    """Reduce(i) right after Backward(i), before Update(i); the plan's step grows by the
    reductions' bytes over the bus only where nothing hides them (the update waits)."""
    model = tiny_hf("llama", layers=2)
    module = tierflow.fit(model, hf_sample(), optimizer=_sgd)
    before = module.plan.step_time(1)
    slow = Reductions(2, all_reduce=True, bus=1e6)  # 1 MB/s: the reductions dominate
    module.reduce_gradients_with(lambda grads: None, slow)
    ops = module.plan.ops
    trained = [i for i, ps in enumerate(module.optimizer.stage_params) if ps]
    for i in trained:
        b = ops.index(Backward(i))
        reduce = next(op for op in ops if isinstance(op, Reduce) and op.stage == i)
        assert ops.index(reduce) == b + 1 < ops.index(Update(i))
        grad_bytes = module.plan.costs.stages[i].param_bytes
        assert reduce.nbytes == slow.link_bytes(grad_bytes) == grad_bytes  # 2 (N-1)/N = 1
    reduced = sum(op.nbytes for op in ops if isinstance(op, Reduce))
    assert module.plan.step_time(1) >= before + 0.99 * reduced / slow.bus
    assert "reduces each stage's gradients over 2 ranks" in module.explain()
    again = type(module.plan).from_json(module.plan.to_json())
    assert again.ops == ops and again.transfers.reductions == slow


def test_a_replicas_exchange_runs_through_the_plan_and_only_what_it_names():
    """The values named in the Reductions are the plan's Exchange ops, handed to the
    exchange given; one it does not name, or a plan with exchanges and no exchange to run
    them, is one clear error."""
    module = tierflow.fit(tiny_hf("llama", layers=2), hf_sample(), optimizer=_sgd)
    names = step_values(all_reduce=True)
    with pytest.raises(TierflowError, match="give reduce_gradients_with an exchange"):
        module.reduce_gradients_with(lambda grads: None,
                                     Reductions(2, all_reduce=True, bus=1e9, exchanged=names))
    seen = []

    def exchange(values, what):
        seen.append((what, values))
        return [values, values]  # two ranks that agree

    module.reduce_gradients_with(lambda grads: None,
                                 Reductions(2, all_reduce=True, bus=1e9, exchanged=names),
                                 exchange)
    assert module.exchange(LOSS, [2.5]) == [[2.5], [2.5]] and seen == [(LOSS, [2.5])]
    with pytest.raises(TierflowError, match="exchanges no 'gradient norm'"):
        module.exchange(GRADIENT_NORM, [1.0])


def test_only_the_last_micro_batch_pays_for_the_reductions():
    model = tiny_hf("llama", layers=2)
    module = tierflow.fit(model, hf_sample(), optimizer=_sgd, grad_accum=3, max_grad_norm=1.0)
    plain = module.plan
    module.reduce_gradients_with(lambda grads: None, Reductions(2, all_reduce=True, bus=1e6))
    reduced = module.plan
    extra = reduced.step_time(3) - plain.step_time(3)
    assert 0 < extra <= reduced.step_time(1) - plain.step_time(1) + 1e-9


def test_zero_plans_gather_each_stage_after_the_step():
    """Each rank stepping its shard (not all_reduce): a Gather per trained stage, first stage
    first, priced one after another on the network; replicas gather nothing."""
    class Recorded:
        def __init__(self):
            self.calls = []

        def reduce_stage(self, stage):
            self.calls.append(("reduce", stage))

        def gather_stage(self, stage):
            self.calls.append(("gather", stage))

        def wait_gathered(self):
            self.calls.append(("wait", None))

    module = tierflow.fit(tiny_hf("qwen2", layers=2), hf_sample())  # the head tied
    shards = Reductions(4, all_reduce=False, bus=1e6, exchanged=step_values(all_reduce=False))
    collectives = Recorded()
    module.run_collectives_with(collectives, shards)
    plan = module.plan
    trained = [op.stage for op in plan.ops if isinstance(op, Reduce)]
    assert [op.stage for op in plan.routines.gathers] == sorted(trained)
    for reduce, gather in zip(sorted((op for op in plan.ops if isinstance(op, Reduce)),
                                     key=lambda op: op.stage), plan.routines.gathers):
        assert reduce.nbytes == gather.nbytes  # reduce-scatter and all-gather: (N-1)/N b
    moved = sum(op.nbytes for op in plan.routines.gathers)
    assert moved == pytest.approx(3 / 4 * sum(p.nbytes for p in module.parameters()), rel=1e-3)
    # the step's values, each an all-gather of 8-byte values over the 4 ranks
    assert [(op.what, op.nbytes) for op in plan.routines.exchanges] == [
        (LOSS, 3 * 8), (GRADIENT_NORM, 3 * 8), (MEMORY_REPORT, 3 * 3 * 8)]
    exchanged = sum(op.nbytes for op in plan.routines.exchanges)
    assert plan.network_time_between_steps == pytest.approx((moved + exchanged) / shards.bus)
    assert "gather ops all-gather the updated shards" in module.explain()
    assert "exchange their loss, gradient norm, memory report" in module.explain()
    again = type(plan).from_json(plan.to_json()).routines
    assert (again.gathers, again.exchanges) == (plan.routines.gathers, plan.routines.exchanges)
    module(**hf_sample()).loss.backward()
    module.gather_parameters()
    reduced = [stage for kind, stage in collectives.calls if kind == "reduce"]
    assert reduced == sorted(trained, reverse=True)
    assert collectives.calls[len(reduced):] == [("gather", i) for i in sorted(trained)] + [
        ("wait", None)]
    replicas = tierflow.fit(tiny_hf("llama"), hf_sample(), optimizer=_sgd)
    replicas.reduce_gradients_with(lambda grads: None, TWO)
    assert replicas.plan.routines.gathers == replicas.plan.routines.exchanges == ()
    assert step_values(all_reduce=True) == (LOSS, MEMORY_REPORT)  # the norm measured alone
