"""The optimizer stepped in host RAM for stages whose AdamW states live on the disk tier below
it (ZeRO-Infinity's NVMe offload), here below a simulated GPU: the states come to host RAM
for the host thread's step and go back after it, never to the compute tier. The training is
plain PyTorch's; the planner prices the move and counts what it holds in host RAM."""
import copy
import threading
from dataclasses import replace

import pytest
import torch
from cli_support import assert_error_line, fp32_train_args, run_main
from models import hf_sample, tiny_hf
from side_by_side import load_states_and_match, train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.exec.disk import DiskStore
from tierflow.exec.host_model import start_in_host_ram
from tierflow.plan.gradient_schedule import GRADS
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.ops import Store
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import place_on_tiers


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _fit_with_states_on_disk(model, sample, disk, grad_accum=1, **config):
    """Every stage streamed from host RAM (where the model starts) and stepped there, its
    AdamW states on ``disk`` (``optimizer_states="disk"``)."""
    start_in_host_ram(model, torch.device("cpu"))
    module = tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", ram="1GiB", disk=disk,
                          grad_accum=grad_accum, max_grad_norm=0.5 if grad_accum > 1 else None,
                          config=FitConfig(simulated_gpu=True, stream="all",
                                           planner="checkpoint-all", host_updates="all",
                                           optimizer_states="disk", **config))
    owned = module.optimizer
    assert isinstance(owned.disk, DiskStore), module.plan.notes
    assert owned.host is not None
    assert owned.host.stages == frozenset(range(len(owned.stage_params)))
    assert "come up to it for each step" in " ".join(module.plan.notes)
    return module


@pytest.mark.parametrize("grad_accum,depth", [(1, 0), (1, 1), (4, 1)])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_states_on_disk_stepped_in_host_ram_train_as_plain_pytorch(family, grad_accum, depth,
                                                                  tmp_path):
    """Every stage's states on disk, stepped in host RAM, reading them ahead or not, inside
    the backward or (4 micro-batches, clipped) in the pass after it: 3 steps with dropout,
    the losses and every parameter as plain PyTorch's."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    module = _fit_with_states_on_disk(model, samples[0], tmp_path, grad_accum=grad_accum,
                                      prefetch_depth=depth)
    train_and_match(module, reference, samples, _adamw)


@pytest.mark.parametrize("grad_accum", [1, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stages_stepped_in_host_ram_beside_stages_updated_on_the_gpu(family, grad_accum,
                                                                     tmp_path, monkeypatch):
    """With only the odd stages open to host steps (``host_updatable`` patched), the
    states of all live on disk: the odd ones
    are read into host RAM for the host thread's step, the even ones come up for the
    (simulated) GPU's update, through the same disk reader and writer. 3 steps as plain
    PyTorch's."""
    from tierflow.fitting import tiers

    monkeypatch.setattr(tiers, "host_updatable", lambda chain: tuple(range(1, len(chain), 2)))
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    start_in_host_ram(model, torch.device("cpu"))
    module = tierflow.fit(model, samples[0], optimizer=_adamw, gpu="1GiB", ram="1GiB",
                          disk=tmp_path, grad_accum=grad_accum,
                          max_grad_norm=0.5 if grad_accum > 1 else None,
                          config=FitConfig(simulated_gpu=True, stream="all",
                                           planner="checkpoint-all", host_updates="all",
                                           optimizer_states="disk"))
    owned = module.optimizer
    stages = [i for i, opt in enumerate(owned.optimizers) if opt is not None]
    assert isinstance(owned.disk, DiskStore)
    assert owned.host.stages == {i for i in stages if i % 2} and len(stages) > 3
    train_and_match(module, reference, samples, _adamw)
    assert all(owned.disk.sizes[f"optimizer-{i}"] > 0 for i in stages)


def test_the_host_thread_moves_the_states_between_disk_and_host_ram(tmp_path):
    """The main thread never waits for a state read: the host thread takes each stage's
    states from disk (read into host RAM) before its step and hands them back after it.
    Between steps every host stage's states are on disk, none in memory."""
    model = tiny_hf("llama", layers=3)
    sample = hf_sample()
    module = _fit_with_states_on_disk(model, sample, tmp_path)
    owned = module.optimizer
    moves = []
    for name in ("_fetch", "_evict"):
        original = getattr(owned, name)

        def spy(i, original=original, name=name):
            moves.append((name, i, threading.current_thread().name))
            return original(i)
        setattr(owned, name, spy)
    for _ in range(2):  # the first step makes the states, the second reads them back
        module(**sample).loss.backward()
    owned.wait()
    stages = sorted(owned.host.stages, reverse=True)
    assert [(name, i) for name, i, _ in moves] == \
        [(name, i) for _ in range(2) for i in stages for name in ("_fetch", "_evict")]
    assert {thread for _, _, thread in moves} == {"tierflow-host-update_0"}
    for i in stages:
        states = owned.optimizers[i].state.values()
        assert states and all(s["exp_avg"].numel() == 0 for s in states)  # on disk
        assert owned.disk.sizes[f"optimizer-{i}"] > 0


def test_a_host_stage_state_dict_on_disk_round_trips(tmp_path):
    """A checkpoint of host stages whose states live on disk holds those states (read back
    for it): a fresh fit of the checkpoint's weights that loads them trains on as the
    uninterrupted module does, bit for bit."""
    model = tiny_hf("llama", layers=3)
    resumed = copy.deepcopy(model)
    sample = hf_sample()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _fit_with_states_on_disk(model, sample, tmp_path / "a")
    first(**sample).loss.backward()
    states = {i: first.optimizer.stage_state_dict(i) for i in first.optimizer.host.stages}
    assert all(s["exp_avg"].numel() > 1 for state in states.values()
               for s in state["state"].values())
    weights = {k.removeprefix("model."): v for k, v in first.state_dict().items()}
    resumed.load_state_dict(weights)
    second = _fit_with_states_on_disk(resumed, sample, tmp_path / "b")
    load_states_and_match(first, second, states, sample)


def _problem(link: float, disk: float, ram_budget: int | None,
             weights_on_disk: bool = False) -> TierProblem:
    """Four like stages of 64 MiB of weights with AdamW (2 bytes of state per weight byte)
    under a GPU whose host RAM (``ram_budget``), where the model starts (or, with
    ``weights_on_disk``, the disk), is reached at ``link`` bytes/s, and a disk of ``disk``
    bytes/s below it."""
    stage = StageCost("layer", fwd_time=0.05, bwd_time=0.1, param_bytes=64 << 20,
                      output_bytes=1 << 20, tape=4 << 20)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=1 << 20,
                       static_bytes=4 * (64 << 20))
    lower = (LowerTier("ram", link, link, ram_budget, "host RAM"),
             LowerTier("disk", disk, disk, None, "the disk tier"))
    return TierProblem(costs=costs, rates=UpdateRates(2.0, 1e-10, 0.0, 0, 2e-10),
                       largest=(64 << 20,) * 4, trainable=4 * (64 << 20),
                       streamable=(0, 1, 2, 3), lower=lower,
                       weights_tiers=lower[1:] if weights_on_disk else lower[:1],
                       host_updatable=(0, 1, 2, 3))


MiB = 1 << 20


def test_host_ram_holds_the_weights_and_three_stages_of_states_read_from_disk():
    """RAM for the weights (256 MiB) but not their states (512 MiB more), and a GPU without
    room for states in flight: the states live on disk and the host steps them in RAM,
    holding the stage stepping, the next one read ahead and the last one being written
    (three stages of 128 MiB, two without reading ahead), beside two stages' gradients
    (2 x 64 MiB)."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all")
    for depth, in_flight in ((1, 3), (0, 2)):
        placed = place_on_tiers(_problem(link=2e9, disk=2e9, ram_budget=800 * MiB),
                                400 * MiB, replace(config, prefetch_depth=depth), "gpu")
        assert placed.states.name == "disk" and placed.weights.name == "ram"
        assert placed.host_stages == frozenset({0, 1, 2, 3})
        held = dict(placed.held)
        assert held["disk"] == 4 * 128 * MiB
        assert held["ram"] == 4 * 64 * MiB + in_flight * 128 * MiB + 2 * 64 * MiB


def test_host_ram_holds_the_weights_a_host_step_reads_from_disk():
    """Weights on disk too (the model starts there): host RAM holds no weights between
    steps, but three stages' states and three stages' weights (the stage stepping's, the
    next one's read ahead, a buffer kept; two of each without reading ahead) and two
    stages' gradients (2 x 64 MiB). Each step takes the weights' read and write longer
    than when they stream from host RAM (at the same bandwidth, so streaming itself costs
    the same): the disk paces these steps; without reading ahead the steps hide part of
    it behind the backward."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all",
                       optimizer_states="disk")
    for depth, in_flight in ((1, 3), (0, 2)):
        placed = {on_disk: place_on_tiers(
            _problem(link=2e9, disk=2e9, ram_budget=800 * MiB, weights_on_disk=on_disk),
            400 * MiB, replace(config, prefetch_depth=depth), "gpu")
            for on_disk in (False, True)}
        from_disk = placed[True]
        assert from_disk.states.name == from_disk.weights.name == "disk"
        assert from_disk.host_stages == frozenset({0, 1, 2, 3})
        held = dict(from_disk.held)
        assert held["disk"] == 4 * 128 * MiB + 4 * 64 * MiB
        assert held["ram"] == in_flight * (128 + 64) * MiB + 2 * 64 * MiB
        assert from_disk.plan.costs.extra["host steps read weights"]  # the [Plan] says so
        assert not placed[False].plan.costs.extra["host steps read weights"]
        weights_io = 2 * (64 * MiB) / 2e9  # read before each of the 4 steps, written after
        extra = from_disk.predicted_time - placed[False].predicted_time
        assert 0 < extra <= 4 * weights_io * (1 + 1e-9)
        if depth:  # the lowest stage's step shows whole (the end of the backward waits for
            # it); each other one what it outlasts of the compute beside it, the next stage's
            # recomputation, backward and gradients down (the plan's Store of them; the
            # plan's timeline: from host RAM the steps hide behind them, from disk each
            # outlasts them)
            plan = from_disk.plan
            stage = plan.costs.stages[0]
            down = next(op for op in plan.ops if isinstance(op, Store) and op.what == GRADS
                        and op.stage == 0)
            beside = stage.fwd_time + stage.bwd_time + stage.update_time + \
                down.nbytes / plan.costs.bandwidths[down.resource]
            shorter = placed[False].plan.costs.stages[0].host_update_time
            assert shorter < beside < stage.host_update_time
            assert extra == pytest.approx(
                weights_io + 3 * (stage.host_update_time - beside), rel=1e-9)


def test_deferred_host_steps_count_the_gradients_that_come_down_to_host_ram():
    """Updates deferred to a pass after the backward (accumulation): a resident stage's
    gradients come down to host RAM for its step there, two stages' at a time (the one
    stepping, the next one queued), beside the weights' host copies and the states; a
    stage streamed from host RAM steps from the gradients stashed there, counted with the
    weights (two bytes per weight byte)."""
    config = FitConfig(planner="checkpoint-all", prefetch_depth=1, host_updates="all",
                       optimizer_states="ram")
    problem = replace(_problem(link=2e9, disk=2e9, ram_budget=2 << 30), deferred=True)
    resident = place_on_tiers(problem, 1 << 30, replace(config, stream="never"), "gpu")
    assert resident.host_stages == frozenset({0, 1, 2, 3}) and not resident.streamed
    assert dict(resident.held)["ram"] == 4 * 128 * MiB + 4 * 64 * MiB + 2 * 64 * MiB
    streamed = place_on_tiers(problem, 1 << 30, replace(config, stream="all"), "gpu")
    assert streamed.host_stages == frozenset({0, 1, 2, 3}) and streamed.weights.name == "ram"
    assert dict(streamed.held)["ram"] == 4 * 128 * MiB + 2 * 4 * 64 * MiB


def test_reading_ahead_hides_the_weights_read_of_a_slow_host_step():
    """When the host's step outlasts the disk's work for a stage (AdamW at 4 ns a byte
    here), reading ahead hides the weights' read behind the step before it: only their
    write, on the host thread after the step, adds to each step."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all",
                       optimizer_states="disk", prefetch_depth=1)
    placed = {}
    for on_disk in (False, True):
        problem = _problem(link=2e9, disk=2e9, ram_budget=800 * MiB, weights_on_disk=on_disk)
        slow = replace(problem, rates=replace(problem.rates, host_seconds_per_byte=4e-9))
        placed[on_disk] = place_on_tiers(slow, 400 * MiB, config, "gpu")
    assert placed[True].weights.name == "disk" and placed[True].host_stages
    write = 64 * MiB / 2e9
    assert placed[True].predicted_time == pytest.approx(
        placed[False].predicted_time + 4 * write, rel=1e-9)


def test_a_deferred_host_step_reads_the_gradients_and_weights_of_a_stage_on_disk():
    """Updates deferred (accumulation) with every stage's weights and states on disk: the
    update pass's host steps each read the stage's weights and write them back (2 x 64 MiB
    more per stage than when they stream from host RAM at the same bandwidth), and the
    plan's Load of each stage's gradients (stashed on disk between micro-batches) reads
    them into host RAM while the step before runs: only the first read adds its 64 MiB.
    Host RAM then holds two stages' gradients beside three stages' states and weights."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all",
                       optimizer_states="disk", prefetch_depth=1)
    placed = {on_disk: place_on_tiers(
        replace(_problem(link=2e9, disk=2e9, ram_budget=2 << 30, weights_on_disk=on_disk),
                deferred=True), 400 * MiB, config, "gpu") for on_disk in (False, True)}
    from_disk = placed[True]
    assert from_disk.weights.name == "disk" and placed[False].weights.name == "ram"
    assert from_disk.host_stages == placed[False].host_stages == frozenset({0, 1, 2, 3})
    extra = from_disk.update_pass.seconds - placed[False].update_pass.seconds
    assert extra == pytest.approx((4 * 2 + 1) * (64 * MiB) / 2e9, rel=1e-9)
    assert dict(from_disk.held)["ram"] == 3 * (128 + 64) * MiB + 2 * 64 * MiB


def test_the_planner_steps_states_from_disk_on_the_host_when_the_gpu_has_no_room_for_them():
    """States on disk come up either to the GPU for its update or to host RAM for a step
    there. Here the disk is as fast as the link, so the GPU's update is faster, and chosen
    where the GPU has room (1 GiB) for the states it updates and reads ahead; the host step
    holds none of them on the GPU, and is chosen under a budget (400 MiB) too small for
    them. With no room in host RAM for three stages' states (and the weights) it is not
    chosen, and asking for it names the RAM it needs."""
    config = FitConfig(stream="all", planner="checkpoint-all", prefetch_depth=1,
                       optimizer_states="disk")
    problem = _problem(link=2e9, disk=2e9, ram_budget=800 * MiB)
    roomy = place_on_tiers(problem, 1 << 30, config, "gpu")
    host = place_on_tiers(problem, 1 << 30, replace(config, host_updates="all"), "gpu")
    assert roomy.states.name == host.states.name == "disk"
    assert not roomy.host_stages and host.host_stages == frozenset({0, 1, 2, 3})
    assert roomy.predicted_time < host.predicted_time
    assert host.predicted_peak < 400 * MiB < roomy.predicted_peak
    tight = place_on_tiers(problem, 400 * MiB, config, "gpu")
    assert tight.states.name == "disk" and tight.host_stages == frozenset({0, 1, 2, 3})
    no_room = _problem(link=2e9, disk=2e9, ram_budget=600 * MiB)
    assert not place_on_tiers(no_room, 1 << 30, config, "gpu").host_stages
    with pytest.raises(tierflow.BudgetError, match="raise ram to at least 768.00 MiB"):
        place_on_tiers(no_room, 1 << 30, replace(config, host_updates="all"), "gpu")


@pytest.mark.parametrize("flags,named", [
    (("--optimizer-states", "disk"), ["--optimizer-states disk", "--disk DIR"]),
    (("--optimizer-states", "ram", "--disk", "{disk}"), ["--optimizer-states ram", "--gpu"]),
    (("--optimizer-states", "compute", "--disk", "{disk}", "--stream", "all"),
     ["--optimizer-states compute", "--stream all", "--stream auto"]),
])
def test_optimizer_states_flags_a_run_cannot_use_are_one_line(train_env, tmp_path, capsys,
                                                              flags, named):
    """--optimizer-states needs the tier it names: one line naming the flag and the fix."""
    flags = [f.format(disk=tmp_path) for f in flags]
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "run", 1, *flags),
                            capsys=capsys)
    assert code == 2
    assert_error_line(err, named)


def test_fit_refuses_a_states_tier_it_does_not_have():
    """``optimizer_states`` names a tier this fit has, for an optimizer it owns."""
    model = tiny_hf("llama", layers=2)
    sample = hf_sample()
    with pytest.raises(tierflow.TierflowError, match="give disk=DIR too"):
        tierflow.fit(model, sample, optimizer=_adamw, ram="1GiB",
                     config=FitConfig(optimizer_states="disk"))
    with pytest.raises(tierflow.TierflowError, match="give gpu= too"):
        tierflow.fit(model, sample, optimizer=_adamw, ram="1GiB",
                     config=FitConfig(optimizer_states="ram"))
    with pytest.raises(tierflow.TierflowError, match="pass optimizer= too"):
        tierflow.fit(model, sample, ram="1GiB", config=FitConfig(optimizer_states="compute"))
    with pytest.raises(ValueError, match="optimizer_states 'nvme' is unknown"):
        FitConfig(optimizer_states="nvme")
    with pytest.raises(ValueError, match="use stream='auto'"):
        FitConfig(optimizer_states="compute", stream="all")
