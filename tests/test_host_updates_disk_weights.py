"""The optimizer stepped in host RAM for stages whose weights stream from disk and whose
AdamW states live there too (ZeRO-Infinity with parameters and states on NVMe), here below
a simulated GPU: the host thread reads a stage's weights into host RAM for its step and
writes them back after it, and the stage's next fetch reads the new file. The training is
plain PyTorch's."""
import threading

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.exec.disk import DiskStore
from tierflow.exec.offload import OffloadedParameters
from tierflow.models.load import load_model


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _models_on_disk(family, directory):
    """A tiny checkpoint of ``family`` with dropout, loaded onto the disk tier in
    ``directory`` (through the real loading code), and the same checkpoint in memory."""
    tiny_hf(family, layers=3, dropout=0.1).save_pretrained(directory / "model")
    offloaded = OffloadedParameters(DiskStore(directory))
    model = load_model(directory / "model", offload=offloaded).train()
    reference = load_model(directory / "model").train()
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


def test_the_host_thread_reads_and_writes_the_weights_around_its_step(tmp_path):
    """Only the host thread moves a host stage's weights between disk and host RAM, one
    read before and one write after each step. Between steps the host copies are empty and
    the files hold the new weights, which the compute tier reads from there."""
    model, _ = _models_on_disk("llama", tmp_path)
    sample = hf_sample()
    module = _fit(model, sample, tmp_path)
    host, offloaded = module.optimizer.host, module.streamer.offloaded
    stages = sorted(host._from_disk, reverse=True)
    moves = []
    for name in ("_weights_in", "_weights_out"):
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
    assert [(name, i) for name, i, _ in moves] == \
        [(name, i) for _ in range(2) for i in stages for name in ("_weights_in", "_weights_out")]
    assert {thread for _, _, thread in moves} == {"tierflow-host-update_0"}
