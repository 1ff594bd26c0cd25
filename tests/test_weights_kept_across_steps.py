"""With updates inside the backward, the first streamed stage is updated last and runs first
in the next step: its weights are written back after the update but stay resident for that
forward, which reads nothing (the one read of a step that no compute could hide). The
planner prices that forward without its read, unless the stage is stepped in host RAM."""
import copy
import threading
import time

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import gathered_parameters, train_side_by_side

import tierflow
from tierflow.config import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.streaming import streamed_costs
from tierflow.plan.tier_costs import LowerTier, updated_on_host


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _fit(tmp_path, planner, depth):
    model = tiny_hf("llama", layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    module = tierflow.fit(model, hf_sample(), optimizer=_adamw, disk=tmp_path,
                          config=FitConfig(planner=planner, stream="all", prefetch_depth=depth))
    return module, reference


def _stage_of_parameters(streamer) -> dict[int, int]:
    return {id(p): i for i, ps in streamer.stage_params.items() for p in ps}


@pytest.mark.parametrize("depth", [0, 1])
def test_the_stages_updated_last_are_read_once_in_three_steps(tmp_path, depth):
    """Keep-all (every stage's weights stay from its forward to its update): the first
    ``depth`` + 1 streamed stages are read for the first step's forward only (or before it,
    by fit's read-ahead), where the next stage is read every step; each update writes them
    back, and their files hold the new weights. The training is plain PyTorch's."""
    module, reference = _fit(tmp_path, "keep-all", depth)
    streamer = module.streamer
    order = sorted(streamer.streamed)
    stage_of = _stage_of_parameters(streamer)
    offloaded = streamer.offloaded
    reads, writes = [], []
    read, write = offloaded.read, offloaded.write
    offloaded.read = lambda p: (reads.append(stage_of[id(p)]), read(p))[1]
    offloaded.write = lambda p: (writes.append(stage_of[id(p)]), write(p))[1]
    train_side_by_side(module, reference, hf_sample(), _adamw)
    streamer.wait_writes()
    params = {i: len(ps) for i, ps in streamer.stage_params.items()}
    for i in order[:depth + 1]:
        assert reads.count(i) <= params[i], (i, reads)  # at most for the first forward
        assert writes.count(i) == 3 * params[i]  # after each of the 3 updates
    after = order[depth + 1]
    assert reads.count(after) >= 3 * params[after]  # every step
    gathered = gathered_parameters(module)
    for name, p in module.model.named_parameters():
        if stage_of.get(id(p)) in order[:depth + 1]:
            on_disk = torch.empty_like(gathered[name])
            offloaded.store.read(offloaded.file_of(p), [on_disk])
            torch.testing.assert_close(on_disk, gathered[name], rtol=0, atol=0)


def test_a_kept_stage_is_dropped_only_after_its_write(tmp_path):
    """Checkpoint-all drops the first stage's weights after its forward (the backward reads
    them again); a write of the kept weights that runs on into that forward is waited for
    before the drop, so the file gets the whole update: the training is plain PyTorch's."""
    module, reference = _fit(tmp_path, "checkpoint-all", 1)
    streamer = module.streamer
    first = min(streamer.streamed)
    stage_of = _stage_of_parameters(streamer)
    offloaded = streamer.offloaded
    write = offloaded.write
    slow = []

    def slow_write(p):
        if stage_of[id(p)] == first and threading.current_thread().name.startswith(
                "tierflow-write"):
            slow.append(p)
            time.sleep(0.3)  # the next step's forward of the stage ends meanwhile
        write(p)
    offloaded.write = slow_write
    train_side_by_side(module, reference, hf_sample(), _adamw)
    assert slow
    gathered = gathered_parameters(module)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(gathered[name], q, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_lone_kept_stage_updates_only_after_its_last_write(tmp_path):
    """One streamed stage, updated inside the backward: it is kept resident from step to
    step, and its write-back may outlast a whole step (with other streamed stages, their
    writes queue behind it and wait for it). Its next update waits for that write, so each
    write holds the weights of its own update, not those of the next (or a mix of both)."""
    from tierflow.exec.disk import DiskStore
    from tierflow.exec.offload import OffloadedParameters
    from tierflow.exec.weights import WeightStreamer
    from tierflow.plan.ops import Backward, Forward, Update

    weight = torch.nn.Parameter(torch.zeros(64))
    offloaded = OffloadedParameters(DiskStore(tmp_path))
    streamer = WeightStreamer({0: [weight]}, offloaded, depth=0, names={id(weight): "w"})
    written: list[float] = []
    write = offloaded.write

    def slow_write(p):
        time.sleep(0.3)  # the next step, the stage's update included, runs meanwhile
        written.append(float(p.detach()[0]))
        write(p)
    offloaded.write = slow_write
    ops = [Forward(0, tape=True), Backward(0), Update(0)]
    for _ in range(3):
        for position, op in enumerate(ops):
            streamer.before(ops, position)
            if isinstance(op, Update):
                with torch.no_grad():
                    weight.add_(1.0)  # the stage's optimizer step
            streamer.after(ops, position, taped={0})
    streamer.wait_writes()
    assert written == [1.0, 2.0, 3.0]
    assert weight.untyped_storage().nbytes() > 0  # kept resident after its last write


def test_the_planner_prices_the_kept_stages_forwards_without_their_reads():
    """The first ``depth`` + 1 streamed stages' forwards cost their compute alone when they
    are kept (those that own parameters the optimizer updates); the others still wait on
    their reads. Stepped in host RAM, a kept stage's copy on the compute tier is stale
    after the step, so it is read again, and priced so."""
    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=10, static_bytes=1000)
    read = {"read_bytes_per_s": 50.0, "write_bytes_per_s": 50.0}
    plain = streamed_costs(costs, {1, 2, 3}, depth=1, **read)
    assert [s.fwd_time for s in plain.stages] == [1.0, 2.0, 2.0, 2.0]  # 100 B at 50 B/s
    for depth, updated, forwards in ((1, {0, 1, 2, 3}, [1.0, 1.0, 1.0, 2.0]),
                                     (0, {0, 1, 2, 3}, [1.0, 1.0, 3.0, 3.0]),
                                     (1, {2, 3}, [1.0, 2.0, 1.0, 2.0])):
        kept = streamed_costs(costs, {1, 2, 3}, depth=depth,
                              kept_across_steps=frozenset(updated), **read)
        assert [s.fwd_time for s in kept.stages] == pytest.approx(forwards)
        assert kept.static_bytes == streamed_costs(costs, {1, 2, 3}, depth=depth,
                                                   **read).static_bytes  # in its buffers
    kept = streamed_costs(costs, {1, 2, 3}, depth=1, kept_across_steps=frozenset({1, 2, 3}),
                          **read)
    assert kept.extra["weights kept across steps"] == {1: 2.0, 2: 2.0}
    ram = LowerTier("ram", 1e3, None, "host RAM")
    state_of = [0, 800, 800, 800]
    for host, forwards in ((frozenset({1, 2, 3}), [2.0, 2.0]), (frozenset({2, 3}), [1.0, 2.0]),
                           (frozenset({3}), [1.0, 1.0])):
        hosted = updated_on_host(kept, costs, state_of, host, frozenset({1, 2, 3}), ram, ram,
                                 1e-3, True)
        assert [hosted.stages[i].fwd_time for i in (1, 2)] == forwards
