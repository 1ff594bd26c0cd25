"""The optimizer stepped in host RAM, where a streamed stage's weights and AdamW states live
below a GPU (exec/host_update.py), here below a simulated GPU: the same training as plain
PyTorch, what moves and what does not, and how the planner prices and chooses it."""
import contextlib
import copy
from dataclasses import replace

import pytest
import torch
from cli_support import assert_error_line, fp32_train_args, run_main, train_losses
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.core.errors import BudgetError
from tierflow.exec.host_store import HostStore
from tierflow.plan import tier_candidates
from tierflow.plan.costs import ChainCosts, StageCost
from tierflow.plan.tier_candidates import TierProblem, UpdateRates
from tierflow.plan.tier_costs import LowerTier
from tierflow.plan.tier_search import place_on_tiers


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _fit_on_host(model, sample, host_updates="all", grad_accum=1, **config):
    return tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", ram="1GiB",
                        grad_accum=grad_accum, max_grad_norm=0.5 if grad_accum > 1 else None,
                        config=FitConfig(simulated_gpu=True, stream="all",
                                         planner="checkpoint-all", host_updates=host_updates,
                                         **config))


@pytest.mark.parametrize("grad_accum,depth", [(1, 0), (1, 1), (4, 1)])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_host_updates_train_as_plain_pytorch(family, grad_accum, depth):
    """Every streamed stage stepped in host RAM, reading ahead or not, inside the backward
    or (4 micro-batches, clipped) in the pass after it from the gradients stashed in host
    RAM: 3 steps with dropout, the losses and every parameter as plain PyTorch's."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    module = _fit_on_host(model, samples[0], grad_accum=grad_accum, prefetch_depth=depth)
    owned = module.optimizer
    assert owned.host is not None and owned.host.stages == module.plan.transfers.weights.host_updated
    # every stage (GPT-2's first one with a host copy of the tied embedding, which stays on
    # the compute tier and is sent up after each step)
    assert owned.host.stages == frozenset(range(len(owned.stage_params)))
    assert "stages in host RAM" in " ".join(module.plan.notes)
    train_and_match(module, reference, samples, _adamw)


@pytest.mark.parametrize("grad_accum", [1, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_resident_weights_stepped_in_host_ram_train_as_plain_pytorch(family, grad_accum):
    """ZeRO-Offload's division: the weights stay on the (simulated) GPU, the AdamW states
    live in host RAM (``optimizer_states="ram"``; where they fit on this GPU the planner
    keeps them there), where the optimizer steps host copies of the weights and sends them
    up after each step (inside the backward, or in the pass after 4 clipped
    micro-batches): 3 steps as plain PyTorch's."""
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    config = dict(simulated_gpu=True, stream="never", planner="checkpoint-all")
    clip = 0.5 if grad_accum > 1 else None
    roomy = tierflow.fit(copy.deepcopy(model), samples[0], optimizer=_adamw, gpu="1GiB",
                         ram="1GiB", grad_accum=grad_accum, max_grad_norm=clip,
                         config=FitConfig(**config))
    assert roomy.optimizer.disk is None  # the states stay on the GPU when it has room
    module = tierflow.fit(model, samples[0], optimizer=_adamw, ram="1GiB", gpu="1GiB",
                          grad_accum=grad_accum, max_grad_norm=clip,
                          config=FitConfig(**config, host_updates="all",
                                           optimizer_states="ram"))
    assert module.streamer is None and isinstance(module.optimizer.disk, HostStore)
    assert module.optimizer.host.stages == frozenset(range(len(module.optimizer.stage_params)))
    train_and_match(module, reference, samples, _adamw)


def test_host_updates_step_the_copies_in_host_ram_and_bring_no_states_up():
    """The host stages' optimizers hold the weights' own host copies (updated in place, not
    written back from the compute tier), and their states are host tensors, never handed to
    the store; the compute tier's copies of those weights are dropped after each update."""
    model = tiny_hf("llama", layers=3)
    sample = hf_sample()
    module = _fit_on_host(model, sample)
    owned, streamer = module.optimizer, module.streamer
    store = streamer.offloaded.store
    assert isinstance(store, HostStore)
    written = []
    original = store.write
    store.write = lambda key, tensors, *after: (written.append(key),
                                                 original(key, tensors, *after))
    before = {i: [store.entries(streamer.offloaded.file_of(p))[0].clone() for p in ps]
              for i, ps in streamer.stage_params.items()}
    module(**sample).loss.backward()
    assert not any(key.startswith("param-") for key in written)  # no weights written back
    assert not any(key.startswith("optimizer-") for key in written)  # no states moved
    for i in owned.host.stages:
        opt = owned.optimizers[i]
        twins = [p for group in opt.param_groups for p in group["params"]]
        entries = [store.entries(streamer.offloaded.file_of(p))[0]
                   for p in owned.stage_params[i]]
        assert {t.data_ptr() for t in twins} == {e.data_ptr() for e in entries}
        assert all(not torch.equal(old, new) for old, new in zip(before[i], entries))
        assert all(p.grad is None for p in owned.stage_params[i])
        assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())


def test_a_host_stage_state_dict_round_trips():
    """A host stage's optimizer state (what a checkpoint writes) loads back into a fresh fit
    of the same model, and training continues as the uninterrupted module does."""
    torch.manual_seed(0)
    model = tiny_hf("llama", layers=2)
    twin = copy.deepcopy(model)
    sample = hf_sample()
    first = _fit_on_host(model, sample)
    second = _fit_on_host(twin, sample)
    first(**sample).loss.backward()
    weights = {k.removeprefix("model."): v for k, v in first.state_dict().items()}
    states = {i: first.optimizer.stage_state_dict(i) for i in first.optimizer.host.stages}
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.untyped_storage().nbytes():
                p.copy_(weights[name])
            else:  # streamed: its copy in host RAM is the one the host optimizer steps
                store = second.streamer.offloaded
                store.store.entries(store.file_of(p))[0].copy_(weights[name])
    for i, state in states.items():
        second.optimizer.load_stage_state(i, state)
    torch.manual_seed(1)
    expected = first(**sample).loss
    torch.manual_seed(1)
    loss = second(**sample).loss
    torch.testing.assert_close(loss, expected)


def _problem(link: float, host_seconds_per_byte: float) -> TierProblem:
    """Four like stages of 64 MiB of weights with AdamW (8 bytes of state per fp32 weight
    byte... 2x), under a GPU whose host RAM is reached at ``link`` bytes/s."""
    stage = StageCost("layer", fwd_time=0.05, bwd_time=0.1, param_bytes=64 << 20,
                      output_bytes=1 << 20, tape=4 << 20)
    costs = ChainCosts(stages=(stage,) * 4, input_bytes=1 << 20,
                       static_bytes=4 * (64 << 20))
    ram = LowerTier("ram", link, link, None, "host RAM")
    return TierProblem(costs=costs,
                       rates=UpdateRates(2.0, 1e-10, 0.0, 0, host_seconds_per_byte),
                       largest=(64 << 20,) * 4, trainable=4 * (64 << 20),
                       streamable=(0, 1, 2, 3), lower=(ram,), host_updatable=(0, 1, 2, 3))


def test_the_planner_steps_on_the_host_when_the_link_is_slow():
    """Over a slow link (0.5 GB/s), moving the states up and down costs more than moving
    gradients down and stepping on the host: the host plan wins, predicted faster and with
    less of the GPU (no states in flight there). At 2 GB/s the states' transfers hide
    behind the compute (the plan's ops overlap the updates and the backwards after them),
    and with a fast link and a slow host the GPU's update wins."""
    config = FitConfig(stream="all", planner="checkpoint-all")
    slow_link = place_on_tiers(_problem(link=5e8, host_seconds_per_byte=2e-10), 1 << 30,
                               config, "gpu")
    assert slow_link.host_stages == frozenset({0, 1, 2, 3})
    hidden = place_on_tiers(_problem(link=2e9, host_seconds_per_byte=2e-10), 1 << 30,
                            config, "gpu")
    assert not hidden.host_stages
    on_gpu = place_on_tiers(_problem(link=5e8, host_seconds_per_byte=2e-10), 1 << 30,
                            FitConfig(stream="all", planner="checkpoint-all",
                                      host_updates="never"), "gpu")
    assert not on_gpu.host_stages
    assert slow_link.predicted_time < on_gpu.predicted_time
    assert slow_link.predicted_peak < on_gpu.predicted_peak
    fast_link = place_on_tiers(_problem(link=1e12, host_seconds_per_byte=1e-8), 1 << 30,
                               config, "gpu")
    assert not fast_link.host_stages


def test_a_simulated_gpus_host_steps_hide_behind_no_backward():
    """Below a simulated GPU the host thread steps on the cores that compute, so its steps
    add to the step whole; below a GPU each hides behind the backward beside it (here
    entirely: 13 ms of step against 100 ms of backward), all but the lowest stage's, which
    the end of the backward waits for either way."""
    from dataclasses import replace

    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all")
    problem = _problem(link=2e9, host_seconds_per_byte=2e-10)
    shared = replace(problem, rates=replace(problem.rates, host_shares_compute=True))
    beside = place_on_tiers(problem, 1 << 30, config, "gpu")
    alone = place_on_tiers(shared, 1 << 30, config, "gpu")
    assert beside.host_stages == alone.host_stages == frozenset({0, 1, 2, 3})
    step = 2e-10 * (64 << 20)
    assert alone.predicted_time - beside.predicted_time == pytest.approx(3 * step, rel=1e-9)


def test_the_host_rate_below_a_simulated_gpu_is_the_compute_tiers():
    """On the CPU, host RAM below the (simulated) GPU steps at the rate measured on the
    compute tier, on its cores; without a host tier there is no host rate."""
    from tierflow.exec.memory import meter_for
    from tierflow.fitting.tiers import update_rates

    cpu = torch.device("cpu")
    params = [torch.nn.Parameter(torch.zeros(1 << 16))]
    ram = LowerTier("ram", 1e9, 1e9, None, "host RAM")
    rates = update_rates(params, _adamw, cpu, meter_for(cpu), None, [ram])
    assert rates.host_shares_compute and rates.host_seconds_per_byte == rates.seconds_per_byte
    alone = update_rates(params, _adamw, cpu, meter_for(cpu), None, [])
    assert alone.host_seconds_per_byte is None and not alone.host_shares_compute


def test_a_deferred_update_pass_steps_host_stages_without_the_link():
    """With updates deferred (accumulation), a stage stepped in host RAM takes its gradients
    from there: the pass moves nothing over the slow link for it and holds nothing of it on
    the GPU, so it is shorter and its peak lower than the pass that brings states, weights
    and gradients up."""
    from dataclasses import replace

    problem = replace(_problem(link=2e9, host_seconds_per_byte=2e-10), deferred=True)
    config = FitConfig(stream="all", planner="checkpoint-all", prefetch_depth=1)
    host = place_on_tiers(problem, 2 << 30, replace(config, host_updates="all"), "gpu")
    gpu = place_on_tiers(problem, 2 << 30, replace(config, host_updates="never"), "gpu")
    assert host.host_stages == frozenset({0, 1, 2, 3}) and not gpu.host_stages
    assert host.update_pass.seconds < gpu.update_pass.seconds
    assert host.update_pass.peak < gpu.update_pass.peak


def test_host_updates_count_their_gradients_in_host_ram():
    """What the host steps hold in host RAM (two stages' gradients) is part of what the
    placement keeps there, so a host budget too small for it refuses that plan."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all")
    placed = place_on_tiers(_problem(link=2e9, host_seconds_per_byte=2e-10), 1 << 30,
                            config, "gpu")
    held = dict(placed.held)["ram"]
    weights_and_states = 4 * (64 << 20) * 3
    assert held == weights_and_states + 2 * (64 << 20)


def test_a_stage_kept_whole_when_host_ram_is_a_little_short():
    """Host RAM one byte short of every streamed stage's weights and states: the planner
    keeps a stage or a few whole on the GPU (weights, gradients, states, stepped there) and
    the others below, stepped in host RAM, rather than refusing."""
    config = FitConfig(planner="checkpoint-all", host_updates="all", optimizer_states="ram")
    problem = _problem(link=2e9, host_seconds_per_byte=2e-10)
    everything = dict(place_on_tiers(problem, 300 << 20, config, "gpu").held)["ram"]
    short = replace(problem.lower[0], budget=everything - 1)
    placed = place_on_tiers(replace(problem, lower=(short,)), 600 << 20, config, "gpu")
    assert placed.states_kept and placed.states_kept.isdisjoint(placed.streamed)
    assert placed.host_stages == frozenset(range(4)) - placed.states_kept
    assert dict(placed.held)["ram"] <= everything - 1
    assert placed.plan.transfers.states is None  # the others' states never leave host RAM


@pytest.mark.exclusive  # its budget is a few KiB above what the process's RSS measures
@pytest.mark.parametrize("grad_accum", [1, 4])
def test_a_stage_kept_whole_on_the_gpu_trains_as_plain_pytorch(monkeypatch, grad_accum):
    """Host RAM at the least any placement needs, on a GPU that keeps no weights resident
    otherwise: a few stages stay whole on the (simulated) GPU, stepped there,
    while the others stream from host RAM and step there (inside the backward, or in the
    pass after 4 clipped micro-batches): 3 steps as plain PyTorch's."""
    monkeypatch.setattr(tier_candidates, "_stream_sets",  # no stage's weights fit otherwise
                        lambda costs, streamable, *args: [tuple(sorted(streamable))])
    model = tiny_hf("llama", layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    config = FitConfig(simulated_gpu=True, planner="checkpoint-all", host_updates="all",
                       optimizer_states="ram")

    def fit(into, ram):
        return tierflow.fit(into, samples[0], optimizer=_adamw, gpu="1GiB", ram=ram,
                            grad_accum=grad_accum,
                            max_grad_norm=0.5 if grad_accum > 1 else None, config=config)

    # what a new fit measures moves by a few KiB (on a loaded machine, at times by more than
    # the 100 KiB that every stage below needs besides, and three tries beside another
    # worker's test and a profile running on the same 2 cores all failed: it runs alone,
    # ``exclusive``): the least budget is asked again
    # before each of up to three tries, and the first that keeps a stage whole is trained
    module, kept = None, set()
    for _ in range(3):
        with pytest.raises(BudgetError) as short:
            fit(copy.deepcopy(model), 1)
        with contextlib.suppress(BudgetError):
            module = fit(copy.deepcopy(model), short.value.smallest + (32 << 10))
            kept = set(range(len(module.optimizer.stage_params))) - module.optimizer.host.stages
            if kept:
                break
    assert kept, "no try kept a stage whole"
    assert "stay whole on the compute tier" in " ".join(module.plan.notes)
    train_and_match(module, reference, samples, _adamw)


def test_the_ram_tiers_reserve_counts_with_what_a_placement_keeps_there():
    """Host RAM below a GPU holds what no plan can use (the GPU runtime's host memory, the
    page-locked heap's unused end): a budget that fits the placement's own bytes but not
    those too refuses it, naming the bytes with the reserve."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all")
    problem = _problem(link=2e9, host_seconds_per_byte=2e-10)
    own = dict(place_on_tiers(problem, 1 << 30, config, "gpu").held)["ram"]
    reserve = 256 << 20
    ram = replace(problem.lower[0], budget=own + reserve, reserve=reserve)
    placed = place_on_tiers(replace(problem, lower=(ram,)), 1 << 30, config, "gpu")
    assert dict(placed.held)["ram"] == own + reserve
    short = replace(ram, budget=own + reserve - 1)
    with pytest.raises(BudgetError, match="outside any plan") as refused:
        place_on_tiers(replace(problem, lower=(short,)), 1 << 30, config, "gpu")
    assert refused.value.smallest == own + reserve


def test_the_page_locked_heaps_slack_is_at_most_the_copies_own_bytes():
    """The unused end of the page-locked heap is at most one segment and at most the bytes
    carved from it (a segment is no larger than the ones before it or its first tensor): a
    placement keeping ``own`` bytes in host RAM is counted at ``2 * own`` under a larger
    slack, at ``own + slack`` under a smaller one, and refused one byte short."""
    config = FitConfig(stream="all", planner="checkpoint-all", host_updates="all")
    problem = _problem(link=2e9, host_seconds_per_byte=2e-10)
    own = dict(place_on_tiers(problem, 1 << 30, config, "gpu").held)["ram"]
    for slack, counted in ((4 * own, 2 * own), (own // 3, own + own // 3)):
        ram = replace(problem.lower[0], budget=counted, heap_slack=slack)
        placed = place_on_tiers(replace(problem, lower=(ram,)), 1 << 30, config, "gpu")
        assert dict(placed.held)["ram"] == counted
        with pytest.raises(BudgetError, match="page-locked heap") as refused:
            place_on_tiers(replace(problem, lower=(replace(ram, budget=counted - 1),)),
                           1 << 30, config, "gpu")
        assert refused.value.smallest == counted



@pytest.mark.parametrize("states,note", [
    ((), "stages in host RAM"),
    (("--optimizer-states", "disk"), "come up to it for each step"),
])
def test_train_on_a_simulated_gpu_steps_in_host_ram_and_resumes(train_env, tmp_path, capsys,
                                                                 states, note):
    """``tierflow train --simulate-gpu --disk --host-updates all``: the model waits in host
    RAM, as below a real GPU, every stage streams from there and is stepped there (clipped,
    in the pass after the backward), its AdamW states in host RAM or, with
    ``--optimizer-states disk``, on disk; the losses are the CPU run's, and a run resumed
    from the step-2 checkpoint (the host optimizers' states loaded back, stage by stage)
    continues with the uninterrupted run's losses. Without --gpu the flag is one line."""
    def train(out, *extra):
        code, stdout, err = run_main(*fp32_train_args(train_env, out, 4, "--save-every", "2",
                                                      *extra), capsys=capsys)
        assert code == 0, err
        return stdout

    disk = tmp_path / "disk"
    disk.mkdir()
    gpu = ("--gpu", "64MiB", "--simulate-gpu", "--ram", "1GiB", "--disk", str(disk),
           "--stream", "all", "--host-updates", "all", *states)
    train(tmp_path / "cpu")
    out = train(tmp_path / "gpu", *gpu)
    assert note in out, out
    assert "for AdamW's steps there" in out, out  # the [Plan]'s ram tier counts them
    expected = train_losses(tmp_path / "cpu")
    torch.testing.assert_close(train_losses(tmp_path / "gpu"), expected, rtol=1e-5, atol=0.0)
    code, out, err = run_main("train", "--resume", str(tmp_path / "gpu" / "step_2"), "--out",
                              str(tmp_path / "resumed"), *gpu, capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(tmp_path / "resumed"),
                               train_losses(tmp_path / "gpu")[2:], rtol=0.0, atol=0.0)
    code, _, err = run_main(*fp32_train_args(train_env, tmp_path / "cpu-host", 1,
                                             "--host-updates", "all"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--host-updates all", "give --gpu too"])


def test_the_fused_kernel_steps_in_host_ram_and_resumes(train_env, tmp_path, capsys,
                                                      monkeypatch):
    """bf16 weights without a master and bf16 moments, every stage stepped in host RAM below
    a (simulated) GPU by the fused AdamW kernel (forced here below its size threshold), on
    the host optimizer's thread: a run resumed from its step-2 checkpoint continues with the
    uninterrupted run's losses, bit for bit."""
    from tierflow.precision import adamw as adamw_module
    from tierflow.precision import fused_adamw

    monkeypatch.setattr(adamw_module, "FUSED_MIN_ELEMENTS", 0)
    fused = []  # the parameters the kernel stepped
    monkeypatch.setattr(adamw_module, "fused_step",
                        lambda *a: fused.append(a[0].numel()) or fused_adamw.fused_step(*a))
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = ("--model-dtype", "bf16", "--master", "none", "--optim-dtype", "bf16",
             "--gpu", "64MiB", "--simulate-gpu", "--ram", "1GiB",
             "--disk", str(disk), "--stream", "all", "--host-updates", "all")
    args = fp32_train_args(train_env, tmp_path / "run", 4, "--save-every", "2", *flags)
    args[args.index("--dtype") + 1] = "bf16"  # bf16 weights compute in bf16
    code, out, err = run_main(*args, capsys=capsys)
    assert code == 0, err
    assert "stages in host RAM" in out, out
    assert fused and fused_adamw._compiled[0] is not None
    code, _, err = run_main("train", "--resume", str(tmp_path / "run" / "step_2"), "--out",
                            str(tmp_path / "resumed"), *flags, capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(tmp_path / "resumed"),
                               train_losses(tmp_path / "run")[2:], rtol=0.0, atol=0.0)


def test_stochastic_rounding_in_host_ram_has_a_cpu_stream_of_its_own(train_env, tmp_path, capsys):
    """With bf16 moments (stochastic rounding) below a (simulated) GPU, the stages stepped in
    host RAM draw from a CPU generator of their own, not the compute device's: the checkpoint
    saves both streams (``generator``, still at its seed here, where every stage steps in host
    RAM, and ``host_generator``, moved on), and a run resumed from it continues with the
    uninterrupted run's losses, bit for bit."""
    from tierflow.precision.rounding import generator_for
    from tierflow.train.checkpoint import load_checkpoint

    disk = tmp_path / "disk"
    disk.mkdir()
    flags = ("--optim-dtype", "bf16", "--gpu", "64MiB", "--simulate-gpu", "--ram", "1GiB",
             "--disk", str(disk), "--stream", "all", "--host-updates", "all")
    code, out, err = run_main(*fp32_train_args(train_env, tmp_path / "run", 4, "--save-every",
                                               "2", *flags), capsys=capsys)
    assert code == 0, err
    assert "stages in host RAM" in out, out
    saved = load_checkpoint(tmp_path / "run" / "step_2").optimizer.read_all()[0]
    seed = 0  # fp32_train_args leaves --seed at its default
    assert torch.equal(saved["generator"], generator_for(torch.device("cpu"), seed).get_state())
    fresh_host = generator_for(torch.device("cpu"), seed + 1).get_state()
    assert not torch.equal(saved["host_generator"], fresh_host)
    code, _, err = run_main("train", "--resume", str(tmp_path / "run" / "step_2"), "--out",
                            str(tmp_path / "resumed"), *flags, capsys=capsys)
    assert code == 0, err
    torch.testing.assert_close(train_losses(tmp_path / "resumed"),
                               train_losses(tmp_path / "run")[2:], rtol=0.0, atol=0.0)
