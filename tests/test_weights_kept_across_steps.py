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
from tierflow.core.config import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost


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
    read_all, write_all = offloaded.read_all, offloaded.write_all
    offloaded.read_all = lambda ps: (reads.extend(stage_of[id(p)] for p in ps), read_all(ps))[1]
    offloaded.write_all = lambda ps, *after: (writes.extend(stage_of[id(p)] for p in ps),
                                              write_all(ps, *after))[1]
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
    write_all = offloaded.write_all
    slow = []

    def slow_write(ps, *after):
        if any(stage_of[id(p)] == first for p in ps) and \
                threading.current_thread().name.startswith("tierflow-write"):
            slow.extend(ps)
            time.sleep(0.3)  # the next step's forward of the stage ends meanwhile
        write_all(ps, *after)
    offloaded.write_all = slow_write
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
    from tierflow.plan.ops import TRANSFERS, Backward, Forward, Store, Update
    from tierflow.plan.weight_schedule import StreamedWeights, schedule_weights

    weight = torch.nn.Parameter(torch.zeros(64))
    offloaded = OffloadedParameters(DiskStore(tmp_path))
    streamer = WeightStreamer({0: [weight]}, offloaded, names={id(weight): "w"})
    schedule = schedule_weights([Forward(0, tape=True), Backward(0), Update(0)],
                                StreamedWeights(((0, weight.nbytes, weight.nbytes),), "disk", "ram",
                                                "disk read", "disk write", depth=0), length=1)
    assert Store("weights", 0, "ram", "disk", "disk write", weight.nbytes, keep=True) in \
        schedule.step
    written: list[float] = []
    write_all = offloaded.write_all

    def slow_write(ps, *after):
        time.sleep(0.3)  # the next step, the stage's update included, runs meanwhile
        written.extend(float(p.detach()[0]) for p in ps)
        write_all(ps, *after)
    offloaded.write_all = slow_write
    for op in schedule.cold:
        streamer.dispatch(op)
    for _ in range(3):  # as the step's runner dispatches the plan
        for op in (*schedule.step, *schedule.between):
            if isinstance(op, TRANSFERS):
                streamer.dispatch(op)
                continue
            streamer.wait_loaded(0)
            if isinstance(op, Update):
                streamer.wait_stored(0)
                with torch.no_grad():
                    weight.add_(1.0)  # the stage's optimizer step
    streamer.wait_writes()
    assert written == [1.0, 2.0, 3.0]
    assert weight.untyped_storage().nbytes() > 0  # kept resident after its last write


def test_the_kept_stages_forwards_read_nothing_unless_stepped_in_host_ram():
    """The first ``depth`` + 1 streamed stages are kept from their update to the next step's
    forward: the plan loads them nowhere in the step, and its price has no read before those
    forwards (the others still wait on theirs). Stepped in host RAM, a kept stage's copy on
    the compute tier is stale after the step: the plan drops it and reads it again."""
    from schedules import step_seconds, streaming

    from tierflow.plan.ops import Backward, Drop, Forward, Load, Update
    from tierflow.plan.weight_schedule import schedule_weights

    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=10, static_bytes=1000,
                       optimizer_owned=True)
    ops = [Forward(i, tape=True) for i in range(4)]
    for i in (3, 2, 1, 0):
        ops += [Backward(i), Update(i)]
    for depth, kept in ((0, {1}), (1, {1, 2})):
        schedule = schedule_weights(ops, streaming(costs, {1, 2, 3}, depth), 4)
        loaded = {op.stage for op in (*schedule.step, *schedule.between)
                  if isinstance(op, Load)}
        assert loaded == {1, 2, 3} - kept and schedule.boundary >= kept
    hosted = schedule_weights(ops, streaming(costs, {1, 2, 3}, 1,
                                             host_updated=frozenset({1, 2, 3})), 4)
    assert {op.stage for op in hosted.step if isinstance(op, Drop)} >= {1, 2, 3}
    assert {op.stage for op in (*hosted.step, *hosted.between)
            if isinstance(op, Load)} == {1, 2, 3}
    # 100 B at 50 B/s: a read lasts a forward and a backward; kept, two fewer reads a step
    kept = step_seconds(costs, ops, {1, 2, 3}, 1, 50.0)
    stale = step_seconds(costs, ops, {1, 2, 3}, 1, 50.0, host_updated=frozenset({1, 2, 3}))
    assert kept < stale
