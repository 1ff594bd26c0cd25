"""The tape transfers a plan places among its ops (plan/tape_schedule.py), their price on the
plan's timeline, and the executor doing exactly what they say."""
import copy

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import train_side_by_side

import tierflow
from tierflow.core.config import FitConfig
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.kept_below import KeptBelow
from tierflow.plan.ops import Backward, Drop, Forward, Load, Store
from tierflow.plan.plan import Plan
from tierflow.plan.strategies import keep_all
from tierflow.plan.tape_offload import offloaded_tape_costs
from tierflow.plan.tape_schedule import TAPE, with_tape_transfers
from tierflow.plan.timeline import timeline
from tierflow.plan.transfers import Transfers

STAGE = StageCost("layer", fwd_time=1.0, bwd_time=2.0, param_bytes=100, output_bytes=10,
                  tape=300)


def _tapes(stages, read_ahead: bool = True) -> KeptBelow:
    return KeptBelow(TAPE, tuple((i, 300) for i in stages), "disk", "ram", "disk read",
                          "disk write", read_ahead)


def _tape_ops(ops):
    return [(type(op).__name__, op.stage) for op in ops
            if isinstance(op, (Store, Load, Drop)) and op.what == TAPE]


KEEP_ALL = (Forward(0, True), Forward(1, True), Forward(2, True),
            Backward(2), Backward(1), Backward(0))


def test_a_tape_held_across_other_ops_goes_down_and_comes_back_one_backward_ahead():
    """The last stage's tape is used at once (its backward follows): it stays. The others
    are written as their forwards save them, each read back while the backward before its
    own runs, and forgotten after their backward."""
    ops = with_tape_transfers(KEEP_ALL, _tapes({0, 1, 2}))
    assert [str(op) if not isinstance(op, (Store, Load, Drop)) else type(op).__name__
            for op in ops] == [
        "Store", "Fall(0)", "Store", "Fall(1)", "Fall(2)", "Load", "B(2)", "Load", "B(1)",
        "Drop", "B(0)", "Drop"]
    assert _tape_ops(ops) == [("Store", 0), ("Store", 1), ("Load", 1), ("Load", 0),
                              ("Drop", 1), ("Drop", 0)]


def test_without_read_ahead_a_tape_is_read_right_before_its_backward():
    ops = with_tape_transfers(KEEP_ALL, _tapes({0, 1, 2}, read_ahead=False))
    position = {(type(op).__name__, getattr(op, "stage", None)): n for n, op in enumerate(ops)}
    assert position[("Load", 1)] == position[("Backward", 1)] - 1
    assert position[("Load", 0)] == position[("Backward", 0)] - 1


def _costs(disk_bytes_per_s: float) -> ChainCosts:
    base = ChainCosts(stages=(STAGE,) * 3, input_bytes=10, static_bytes=1000)
    return offloaded_tape_costs(base, {0, 1, 2}, home="disk", read_bytes_per_s=disk_bytes_per_s,
                                write_bytes_per_s=disk_bytes_per_s)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_slow_disk_makes_the_step_wait_for_its_tapes(read_ahead):
    """Priced as a task graph: a disk fast enough hides the tapes' writes and (read ahead)
    reads behind compute (the step is its compute), a slow one makes the backwards wait for their reads;
    reading ahead hides more of it than reading on demand."""
    compute = 3 * (STAGE.fwd_time + STAGE.bwd_time)
    ops = with_tape_transfers(KEEP_ALL, _tapes({0, 1, 2}, read_ahead))
    exposed = 0.0 if read_ahead else 2 * 300 / 1e6  # reads on demand: two tapes come back
    assert timeline(_costs(1e6), ops).time == pytest.approx(compute + exposed)
    slow = timeline(_costs(100.0), ops)  # 3 s a tape each way
    assert slow.time > compute + 1.0
    spans = {(s.name.split("(")[0], s.resource) for s in slow.spans}
    assert any(resource == "disk write" for _, resource in spans)
    assert any(resource == "disk read" for _, resource in spans)
    if read_ahead:
        on_demand = with_tape_transfers(KEEP_ALL, _tapes({0, 1, 2}, read_ahead=False))
        assert slow.time < timeline(_costs(100.0), on_demand).time


def test_the_plan_carries_its_tapes_through_json():
    """A plan with tape transfers reads back from its JSON with the same ops and
    transfers."""
    costs = _costs(100.0)
    plan = Plan(costs=costs, ops=tuple(keep_all(costs)), strategy="keep-all")
    placed = plan.with_transfers(Transfers(tapes=_tapes({0, 1})))
    assert _tape_ops(placed.ops) == [("Store", 0), ("Store", 1), ("Load", 1), ("Load", 0),
                                     ("Drop", 1), ("Drop", 0)]
    back = Plan.from_json(placed.to_json())
    assert back.ops == placed.ops and back.transfers == placed.transfers
    assert back.decisions() == placed.decisions()
    assert placed.decisions()["tapes"] == [0, 1] and placed.decisions()["tapes_home"] == "disk"


def test_the_executor_writes_the_tapes_the_plan_stores_and_no_other(tmp_path, monkeypatch):
    """fit with every tape offloaded: the stages whose tapes the executor wrote are exactly
    those of the plan's tape Stores, and training is plain PyTorch's."""
    from tierflow.exec import tapes as tapes_module

    written: set[int] = set()
    original = tapes_module.TapeOffload._write
    monkeypatch.setattr(tapes_module.TapeOffload, "_write",
                        lambda self, store, key, t, order: (written.add(store.stage),
                                                            original(self, store, key, t, order)))
    monkeypatch.setattr(tapes_module, "MIN_BYTES", 1)
    model = tiny_hf("llama", layers=4)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    module = tierflow.fit(model, sample, optimizer=adamw, disk=tmp_path,
                          config=FitConfig(planner="keep-all", offload_tapes="all",
                                           stream="never"))
    stored = {op.stage for op in module.plan.ops if isinstance(op, Store) and op.what == TAPE}
    assert stored and module.plan.transfers.tapes is not None
    train_side_by_side(module, reference, sample, adamw)
    assert written == stored


class _AdaptedLayer(torch.nn.Module):
    """A frozen projection with a trainable low-rank adapter beside it, as LoRA trains."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(64, 256).requires_grad_(False)
        self.down = torch.nn.Linear(64, 4, bias=False)
        self.up = torch.nn.Linear(4, 256, bias=False)

    def forward(self, x, ctx):
        return torch.nn.functional.gelu(self.base(x) + self.up(self.down(x)))


def test_an_offloaded_stage_keeps_none_of_its_tape_in_memory(tmp_path):
    """The plan moves a stage's whole tape to the lower tier (plan/tape_offload.py: its tape
    is 0 in memory). Under bf16 autocast each tensor a short sequence saves is far under
    MIN_BYTES; the executor kept those in memory, and a LoRA run at seq 256 held its layers'
    whole tapes beside the plan's peak (254 MiB measured against --ram 240MiB). What the
    hooks keep in memory is no tape, and the gradients are those of the tape kept whole."""
    from tierflow.exec import tapes as tapes_module
    from tierflow.exec.context import AutocastMode
    from tierflow.exec.disk import DiskStore
    from tierflow.exec.stage_call import backward_taped, forward_taped, storage_key, tape_bytes

    torch.manual_seed(0)
    stage = _AdaptedLayer()
    x = torch.randn(2, 16, 64)
    autocast = AutocastMode("cpu", True, torch.bfloat16)
    params = {storage_key(p) for p in stage.parameters()}
    whole = forward_taped(stage, x, {}, autocast, input_grad=True)
    assert 0 < tape_bytes(whole, params) < tapes_module.MIN_BYTES
    assert max(whole.saved.values()) < tapes_module.MIN_BYTES
    expected = backward_taped(whole, torch.ones_like(whole.y))
    grads = [p.grad.clone() for p in stage.parameters() if p.requires_grad]
    stage.zero_grad()

    offload = tapes_module.TapeOffload(DiskStore(tmp_path), params)
    hooks = offload.hooks(Store(TAPE, 0, "ram", "disk", "disk write", 1))
    taped = forward_taped(stage, x, {}, autocast, input_grad=True, offload=hooks)
    assert tape_bytes(taped, params) == 0
    offload.dispatch(Load(TAPE, 0, "disk", "ram", "disk read", 1))
    assert torch.equal(backward_taped(taped, torch.ones_like(taped.y)), expected)
    for p, g in zip([p for p in stage.parameters() if p.requires_grad], grads):
        assert torch.equal(p.grad, g)


class _ManySmallSaves(torch.nn.Module):
    """Saves many small tensors, some of them transposed views (as attention's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_AdaptedLayer() for _ in range(3))
        self.back = torch.nn.Linear(256, 64)

    def forward(self, x, ctx):
        for layer in self.layers:
            h = layer(x, ctx)
            scores = torch.matmul(h.transpose(1, 2), h).softmax(-1)  # saves h transposed
            x = x + self.back(torch.matmul(h, scores)).tanh()
        return x


def test_an_offloaded_stages_small_saved_tensors_go_down_as_one_file(tmp_path):
    """Each saved tensor under PACK_BELOW went down as its own direct-I/O file (a few syscalls
    and a padded block each, dozens per layer per step). They go down packed: one write and
    one read for the stage, viewed back as the saved tensors with their own strides, and the
    gradients are bit for bit those of the tape kept in memory."""
    from tierflow.exec import tapes as tapes_module
    from tierflow.exec.context import AutocastMode
    from tierflow.exec.disk import DiskStore
    from tierflow.exec.stage_call import backward_taped, forward_taped, storage_key, tape_bytes

    torch.manual_seed(0)
    stage = _ManySmallSaves()
    x = torch.randn(2, 16, 64)
    for autocast in (AutocastMode("cpu", False, torch.float32),
                     AutocastMode("cpu", True, torch.bfloat16)):
        params = {storage_key(p) for p in stage.parameters()}
        whole = forward_taped(stage, x, {}, autocast, input_grad=True)
        assert len(whole.saved) > 10
        expected = backward_taped(whole, torch.ones_like(whole.y))
        trained = [p for p in stage.parameters() if p.requires_grad]
        grads = [p.grad.clone() for p in trained]
        stage.zero_grad()

        store = DiskStore(tmp_path)
        writes, reads = [], []
        write, read = store.write, store.read
        store.write = lambda key, ts, *after: (writes.append(key), write(key, ts, *after))[1]
        store.read = lambda key, ts, *after: (reads.append(key), read(key, ts, *after))[1]
        offload = tapes_module.TapeOffload(store, params)
        down = Store(TAPE, 0, "ram", "disk", "disk write", 1)
        taped = forward_taped(stage, x, {}, autocast, input_grad=True,
                              offload=offload.hooks(down))
        offload.finish(down)
        assert tape_bytes(taped, params) == 0
        offload.dispatch(Load(TAPE, 0, "disk", "ram", "disk read", 1))
        assert torch.equal(backward_taped(taped, torch.ones_like(taped.y)), expected)
        for p, g in zip(trained, grads):
            assert torch.equal(p.grad, g)
        stage.zero_grad()
        assert writes == reads == ["tape-0-pack-0"]
        offload.dispatch(Drop(TAPE, 0, "compute"))


def test_a_tape_read_back_is_growth_that_mallocs_caches_do_not_serve(tmp_path):
    """The tape reader thread allocates the buffers a Load reads into in its own malloc arena:
    the blocks the compute thread freed (the LM head's logits) cannot serve them. HostRoom
    counted them as served, skipped the trim before llama-20m LoRA's last layer's backward
    (RSS + growth - cache just under the limit) and the step peaked 6 MiB past the plan's
    prediction (242.6 MiB, --ram 240MiB). The room asked before a tape's Load counts its bytes
    among the blocks the caches cannot serve."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                      torch.nn.Linear(256, 64))
                                  for _ in range(4)])
    sample = torch.randn(1024, 64)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    module = tierflow.fit(model, sample, optimizer=adamw, ram="1GiB", disk=tmp_path,
                          config=FitConfig(planner="keep-all", offload_tapes="all",
                                           stream="never"))
    room = module._host_room
    assert room is not None and module.plan.transfers.tapes is not None
    asked: list[tuple[int, int]] = []
    make_room, position = room.make_room, {}
    module_make_room = module._make_room
    module._make_room = lambda p: (position.__setitem__("at", p), module_make_room(p))[1]
    room.make_room = lambda nbytes, fresh=False, largest=0: (
        asked.append((position["at"], largest)), make_room(nbytes, fresh, largest))[1]
    module(sample).sum().backward()
    from tierflow.plan.ops import TRANSFERS
    ops = module.plan.ops
    loads = 0
    for at, largest in asked:
        reads = 0
        for op in reversed(ops[:at]):  # the transfers placed before it
            if not isinstance(op, TRANSFERS):
                break
            if isinstance(op, Load) and op.what == TAPE:
                reads += op.nbytes
        loads += reads > 0
        assert largest >= reads > 0 or reads == 0
    assert loads
