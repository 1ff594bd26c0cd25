"""Optimizer states on a lower tier read on demand (no read-ahead): each read waits for the
write of the states updated before it (``Load.after_store``), so one stage's states are in
memory at a time, in one buffer of the largest stage's size. The plan places and prices it
(plan/state_schedule.py, plan/timeline.py, plan/tier_costs.py) and the executor runs it
(exec/optimizer.py, exec/buffers.py); training stays plain PyTorch's."""
import copy
import threading
import time
from dataclasses import replace

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Load, Update, op_from_dict
from tierflow.plan.state_schedule import STATES, with_state_transfers
from tierflow.plan.tier_costs import LowerTier, states_below
from tierflow.plan.timeline import timeline

STATE_BYTES = 400  # each stage's optimizer states
STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=30, update_time=0.5, update_transient=7)


def _states(read_ahead: bool, home: str = "disk") -> KeptBelow:
    """Three stages' states on the disk below host RAM, or in host RAM below a GPU."""
    where = ("disk", "ram", "disk read", "disk write") if home == "disk" else \
        ("ram", "gpu", "copy up", "copy down")
    return KeptBelow(STATES, tuple((i, STATE_BYTES) for i in range(3)), *where, read_ahead)


def _updates(states: KeptBelow) -> tuple:
    """Three stages' Updates, last first, with their states' Loads and Stores."""
    return with_state_transfers([Update(2), Update(1), Update(0)], states)


@pytest.mark.parametrize("read_ahead", [False, True])
def test_only_a_read_on_demand_waits_for_the_write_before(read_ahead):
    """Read on demand, each Load comes right before its Update and says it waits for the
    last Store of states; read ahead, none does. The flag survives the plan's JSON, which
    names it only where it is set."""
    ops = _updates(_states(read_ahead))
    loads = [op for op in ops if isinstance(op, Load)]
    assert [op.after_store for op in loads] == [not read_ahead] * 3
    if not read_ahead:
        assert [type(op).__name__ for op in ops] == ["Load", "Update", "Store"] * 3
    for op in loads:
        data = op.to_dict()
        assert ("after_store" in data) == op.after_store
        assert op_from_dict(data) == op


def test_the_timeline_starts_a_read_on_demand_once_the_write_before_ended():
    """States in host RAM below a GPU, whose copies up and down run on streams of their own
    and whose link down is slow: read on demand, stage 1's states come up only after stage
    2's went down, and the step takes that wait; the same Loads without the flag would read
    beside the write. (A disk's reads and writes take turns anyway.)"""
    costs = ChainCosts(stages=(STAGE,) * 3, input_bytes=10, static_bytes=1000,
                       optimizer_owned=True,
                       bandwidths={"copy up": 1000.0, "copy down": 100.0})
    states = _states(read_ahead=False, home="ram")
    ops = _updates(states)
    beside = tuple(replace(op, after_store=False) if isinstance(op, Load) else op
                   for op in ops)
    write_2, read_1 = ops.index(states.store(2)), ops.index(states.load(1, after_store=True))
    waiting, reading = timeline(costs, ops), timeline(costs, beside)
    spans = {s.position: s for s in waiting.spans}
    assert spans[read_1].start >= spans[write_2].end
    assert {s.position: s for s in reading.spans}[read_1].start < spans[write_2].end
    assert reading.time < waiting.time


@pytest.mark.parametrize("read_ahead", [False, True])
def test_states_read_on_demand_count_one_buffer(read_ahead):
    """The costs of states below: read ahead, two stages' states in flight besides the one
    updating (in its transient); on demand, one buffer that every stage's states take in
    turn, nothing more while it updates."""
    base = ChainCosts(stages=(STAGE,) * 3, input_bytes=10, static_bytes=1000,
                      optimizer_owned=True)
    disk = LowerTier("disk", 1 << 30, 1000.0, 100.0, about="the disk tier")
    moved = states_below(base, base, base.stages, [STATE_BYTES] * 3, disk, read_ahead)
    assert moved.static_bytes == 1000 + (2 if read_ahead else 1) * STATE_BYTES
    assert [s.update_transient for s in moved.stages] == \
        [7 + (STATE_BYTES if read_ahead else 0)] * 3
    assert moved.state_buffer_bytes == STATE_BYTES


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_states_read_on_demand_hold_one_stage_at_a_time_and_train_as_plain_pytorch(
        family, tmp_path):
    """AdamW states on the disk tier (the plan keeps some stages' on the compute tier), read
    on demand: over 3 steps no read of states runs beside a write of them, the step of every
    stage whose states live there begins after the writes begun before it have ended (the first step's states are made anew, the dispatcher waits),
    every buffer the states are read into has the largest stage's size (the embeddings'
    states are larger than a layer's), and losses and parameters are plain PyTorch's."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    module = tierflow.fit(model, hf_sample(), optimizer=_adamw, disk=tmp_path,
                          config=FitConfig(optimizer_states="disk", prefetch_depth=0))
    owned = module.optimizer
    assert owned.disk is not None and not owned.read_ahead
    loads = [op for op in module.plan.ops if isinstance(op, Load) and op.what == STATES]
    assert loads and all(op.after_store for op in loads)
    events, lock = [], threading.Lock()  # (kind, key, start, end)

    def timed(kind, method, key=None):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = method(*args, **kwargs)
            with lock:
                events.append((kind, args[0] if key is None else key, start,
                               time.perf_counter()))
            return out
        return run

    owned.disk.read = timed("read", owned.disk.read)  # key: the file's
    owned.disk.write = timed("write", owned.disk.write)
    for i, opt in enumerate(owned.optimizers):
        if opt is not None:
            opt.step = timed("step", opt.step, key=i)
    sizes = []
    allocate = owned._pool._allocate
    owned._pool._allocate = lambda nbytes: (sizes.append(nbytes), allocate(nbytes))[1]
    train_and_match(module, reference, [hf_sample()], _adamw)
    owned.wait()
    below = module.plan.transfers.states.stages  # the others' stay (static bytes)
    keys = {f"optimizer-{i}" for i in below}  # the disk tier holds some weights too
    reads = [e for e in events if e[0] == "read" and e[1] in keys]
    writes = [e for e in events if e[0] == "write" and e[1] in keys]
    assert len(below) > 1 and reads and writes
    for _, key, start, end in reads:
        assert all(end <= w_start or w_end <= start for _, _, w_start, w_end in writes), key
    for _, stage, start, _ in (e for e in events if e[0] == "step" and e[1] in below):
        assert all(w_end <= start for _, _, w_start, w_end in writes if w_start < start), stage
    largest = max(sum(shape.numel() * dtype.itemsize
                      for shape, dtype in owned.offloaded_shapes(i).values()) for i in below)
    assert sizes and len(set(sizes)) == 1 and sizes[0] >= largest
