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
def test_the_stage_updated_last_is_read_once_in_three_steps(tmp_path, depth):
    """Keep-all (every stage's weights stay from its forward to its update): the first
    streamed stage is read for the first step's forward only (or before it, by fit's read
    ahead), where the next stage is read every step; each update writes it back, and its
    file holds the new weights. The training is plain PyTorch's."""
    module, reference = _fit(tmp_path, "keep-all", depth)
    streamer = module.streamer
    first = min(streamer.streamed)
    stage_of = _stage_of_parameters(streamer)
    offloaded = streamer.offloaded
    reads, writes = [], []
    read, write = offloaded.read, offloaded.write
    offloaded.read = lambda p: (reads.append(stage_of[id(p)]), read(p))[1]
    offloaded.write = lambda p: (writes.append(stage_of[id(p)]), write(p))[1]
    train_side_by_side(module, reference, hf_sample(), _adamw)
    streamer.wait_writes()
    params = len(streamer.stage_params[first])
    assert reads.count(first) <= params  # at most for the first forward (fit may have)
    assert writes.count(first) == 3 * params  # after each of the 3 updates
    assert reads.count(first + 1) >= 3 * len(streamer.stage_params[first + 1])  # each step
    gathered = gathered_parameters(module)
    named = dict(module.model.named_parameters())
    for name, p in named.items():
        if stage_of.get(id(p)) == first:
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


def test_the_planner_prices_the_kept_stages_forward_without_its_read():
    """The first streamed stage's forward costs its compute alone when it is kept; the
    others still wait on their reads. Stepped in host RAM, its copy on the compute tier is
    stale after the step, so it is read again, and priced so."""
    stage = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                      tape=30)
    costs = ChainCosts(stages=(stage, stage, stage), input_bytes=10, static_bytes=1000)
    read = {"read_bytes_per_s": 50.0, "write_bytes_per_s": 50.0, "depth": 1}
    plain = streamed_costs(costs, {1, 2}, **read)
    kept = streamed_costs(costs, {1, 2}, kept_across_steps=True, **read)
    assert [s.fwd_time for s in plain.stages] == [1.0, 2.0, 2.0]  # 100 B at 50 B/s: 2 s
    assert [s.fwd_time for s in kept.stages] == [1.0, 1.0, 2.0]
    assert kept.static_bytes == plain.static_bytes  # one of the buffers holds it
    assert kept.extra["weights kept across steps"] == (1, 2.0)
    ram = LowerTier("ram", 1e3, None, "host RAM")
    state_of = [0, 800, 800]
    for host, forward in ((frozenset({1, 2}), 2.0), (frozenset({2}), 1.0)):
        hosted = updated_on_host(kept, costs, state_of, host, frozenset({1, 2}), ram, ram,
                                 1e-3, True)
        assert hosted.stages[1].fwd_time == forward
