"""The optimizer stepped in host RAM for stages whose weights stream from disk and whose
AdamW states live there too (ZeRO-Infinity with parameters and states on NVMe), here below
a simulated GPU: the host thread reads a stage's weights into host RAM for its step and
writes them back after it, and the stage's next fetch reads the new file. The training is
plain PyTorch's. ``tierflow train`` builds a model whose weights pass ``--ram`` on disk
below a GPU, so that its weights stream from there."""
import re
import threading

import pytest
import torch
from cli_support import train_like_the_cpu_and_resume
from models import hf_sample, tiny_hf
from side_by_side import load_states_and_match, train_and_match

import tierflow
from tierflow import FitConfig
from tierflow import load_model
from tierflow.exec.disk import DiskStore
from tierflow.exec.offload import offloaded_parameters


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _models_on_disk(family, directory):
    """A tiny checkpoint of ``family`` with dropout, loaded onto the disk tier in
    ``directory`` (through the real loading code), and the same checkpoint in memory."""
    tiny_hf(family, layers=3, dropout=0.1).save_pretrained(directory / "model")
    model = load_model(directory / "model", disk=directory)
    reference = load_model(directory / "model")
    return model, reference


def _fit(model, sample, directory, grad_accum=1, depth=1):
    """Every stage streamed from disk below a simulated GPU and stepped in host RAM, its
    AdamW states on disk too."""
    module = tierflow.fit(model, sample, optimizer=_adamw, gpu="1GiB", ram="1GiB",
                          disk=directory, grad_accum=grad_accum,
                          max_grad_norm=0.5 if grad_accum > 1 else None,
                          config=FitConfig(simulated_gpu=True, stream="all",
                                           planner="checkpoint-all", host_updates="all",
                                           optimizer_states="disk", prefetch_depth=depth))
    owned = module.optimizer
    assert isinstance(module.streamer.offloaded.store, DiskStore)
    assert isinstance(owned.disk, DiskStore)
    stages = {i for i, opt in enumerate(owned.optimizers) if opt is not None}
    assert owned.host.stages == stages
    assert set(owned.host._from_disk) == set(module.streamer.stage_params) & stages
    assert "for their step and go back after it" in " ".join(module.plan.notes)
    return module


@pytest.mark.parametrize("grad_accum,depth", [(1, 0), (1, 1), (4, 1)])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weights_and_states_on_disk_stepped_in_host_ram_train_as_plain_pytorch(
        family, grad_accum, depth, tmp_path):
    """Weights and states on disk, stepped in host RAM, reading ahead or not, inside the
    backward or (4 micro-batches, clipped) in the pass after it, the gradients then read
    from disk for the step: 3 steps with dropout, the losses and every parameter as plain
    PyTorch's."""
    model, reference = _models_on_disk(family, tmp_path)
    samples = [hf_sample(seed=k) for k in range(grad_accum)]
    module = _fit(model, samples[0], tmp_path, grad_accum, depth)
    train_and_match(module, reference, samples, _adamw)


@pytest.mark.parametrize("depth,reader", [(1, "tierflow-host-weights-read_0"),
                                          (0, "tierflow-host-update_0")])
def test_each_host_step_reads_and_writes_its_weights_once(tmp_path, depth, reader):
    """Each step of a host stage reads its weights from disk once (as the stage is handed
    over, on a reader thread, when reading ahead; else on the host thread) and the host
    thread writes them back once after it. Between steps the host copies are empty and the
    files hold the new weights, which the compute tier reads from there."""
    model, _ = _models_on_disk("llama", tmp_path)
    sample = hf_sample()
    module = _fit(model, sample, tmp_path, depth=depth)
    host, offloaded = module.optimizer.host, module.streamer.offloaded
    stages = sorted(host._from_disk, reverse=True)
    moves = []
    for name in ("_read_weights", "_weights_out"):
        original = getattr(host, name)

        def spy(*args, original=original, name=name):
            moves.append((name, args[0], threading.current_thread().name))
            return original(*args)
        setattr(host, name, spy)
    for _ in range(2):
        old = {i: [offloaded.current_copy(p) for p in module.streamer.stage_params[i]]
               for i in stages}
        module(**sample).loss.backward()
        module.optimizer.wait()
        for i in stages:
            assert all(twin.untyped_storage().nbytes() == 0 for twin, _, _ in host._from_disk[i])
            new = [offloaded.current_copy(p) for p in module.streamer.stage_params[i]]
            assert all(not torch.equal(a, b) for a, b in zip(old[i], new))
    for name, thread in (("_read_weights", reader), ("_weights_out", "tierflow-host-update_0")):
        assert sorted(i for n, i, _ in moves if n == name) == sorted(2 * stages)
        assert {t for n, _, t in moves if n == name} == {thread}


def test_train_builds_a_model_larger_than_ram_on_disk_below_a_simulated_gpu(train_env, tmp_path,
                                                                         capsys):
    """``tierflow train --simulate-gpu --gpu G --ram R --disk D`` with more weights than R:
    the model is built on the disk tier, not in host RAM (which could not hold it), and its
    stages stream from there; the losses are the CPU run's, and a run resumed from the
    step-2 checkpoint goes on with the uninterrupted run's losses."""
    disk = tmp_path / "disk"
    disk.mkdir()
    gpu = ("--gpu", "64MiB", "--simulate-gpu", "--ram", "48KiB", "--disk", str(disk),
           "--stream", "all")
    out = train_like_the_cpu_and_resume(train_env, tmp_path, gpu, capsys, rtol=1e-5)
    weights = re.search(r"weights +: ([\d.]+) KiB", out)
    assert weights and float(weights[1]) > 48, out
    assert re.search(r"the weights of \d+ of \d+ stages \(.*\) live in the disk tier", out), out


def test_train_builds_the_model_on_disk_when_ram_cannot_hold_the_step_beside_it(
        train_env, tmp_path, capsys):
    """Weights that fit ``--ram`` but leave too little of it for the step: the model built
    in host RAM gets no plan there, so it is built again on the disk tier, with a note that
    says why; it trains as on the CPU and resumes bit for bit (the resumed run takes the
    same way)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    gpu = ("--gpu", "64MiB", "--simulate-gpu", "--ram", "300KiB", "--disk", str(disk),
           "--stream", "all")
    out = train_like_the_cpu_and_resume(train_env, tmp_path, gpu, capsys, rtol=1e-5)
    note = re.search(r"note: the model's weights \(([\d.]+) KiB\) fit --ram 300.00 KiB, "
                     r"but a step with them there needs ([\d.]+) KiB of it: building the "
                     r"model on the disk tier", out)
    assert note and float(note[1]) < 300 < float(note[2]), out
    header = out.index("[Options]")
    assert out.count("[Options]") == 1 and header < note.start(), out  # printed once, first
    assert re.search(r"the weights of \d+ of \d+ stages \(.*\) live in the disk tier", out), out


def test_moving_a_model_built_on_disk_keeps_its_weights_on_disk(tmp_path):
    """``move_model`` (what fit does with a model built on disk and a sample on a GPU; here
    onto the CPU): each weight that lives on disk is an empty tensor on the device, still
    known to the disk tier and read back from its file with its values."""
    model, reference = _models_on_disk("gpt2", tmp_path)
    offloaded = offloaded_parameters(model)
    on_disk = [p for p in model.parameters() if p in offloaded]
    keys = [offloaded.file_of(p) for p in on_disk]
    offloaded.move_model(model, torch.device("cpu"))
    assert [offloaded.file_of(p) for p in on_disk] == keys
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p in offloaded) == (p.untyped_storage().nbytes() == 0)
        with offloaded.resident([p]):
            torch.testing.assert_close(p, expected[name], rtol=0, atol=0)


def test_a_checkpoint_of_host_stages_on_disk_resumes_bit_for_bit(tmp_path):
    """Weights and AdamW states of every host stage on disk: the module's weights (read
    back from disk) and each stage's states make a checkpoint; a model loaded onto another
    disk tier from it, fitted the same way and given those states, trains on as the
    uninterrupted module does, bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, reference = _models_on_disk("llama", tmp_path / "a")
    sample = hf_sample()
    first = _fit(model, sample, tmp_path / "a")
    first(**sample).loss.backward()
    owned = first.optimizer
    states = {i: owned.stage_state_dict(i) for i in owned.host.stages}
    assert all(s["exp_avg"].numel() > 1 for state in states.values()
               for s in state["state"].values())
    reference.load_state_dict({k.removeprefix("model."): v
                               for k, v in first.state_dict().items()})
    reference.save_pretrained(tmp_path / "b" / "model")
    resumed = load_model(tmp_path / "b" / "model", disk=tmp_path / "b")
    second = _fit(resumed, sample, tmp_path / "b")
    load_states_and_match(first, second, states, sample)
