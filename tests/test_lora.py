"""LoRA adapters injected by peft (``models/lora.py``) train through tierflow's chain as the same
peft model does in plain PyTorch: the loss and every adapter gradient, fp32, for Llama and
Qwen2 (its head tied to its frozen embedding), under a plan that recomputes and with the base
streamed from disk, where no frozen weight is ever written back; then three AdamW steps end
with the same adapters. The chain finds the model's parts through the injected layers."""
import copy

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import train_and_match

import tierflow
from tierflow import FitConfig
from tierflow.core.errors import TierflowError
from tierflow.models.lora import ALL_LINEAR, LoraSpec, add_adapters, split_targets

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=ALL_LINEAR)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _adapted(family: str):
    """A tiny ``family`` model with adapters on every projection, their B not zero (so that A
    takes a gradient too), and its plain twin: the same peft model, deep-copied."""
    model = tiny_hf(family, layers=3)
    add_adapters(model, SPEC, seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, copy.deepcopy(model)


def _gradients(model, sample) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch: the loss and every adapter's gradient by name."""
    loss = model(**sample).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_only_the_adapters_train_and_their_init_follows_the_seed(family):
    model, _ = _adapted(family)
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trains and all(".lora_A." in n or ".lora_B." in n for n in trains)
    assert len(trains) == 2 * 7 * 3  # A and B of 7 projections in each of 3 layers
    inits = []
    for seed in (0, 0, 1):
        adapted = tiny_hf(family, layers=3)
        state = torch.get_rng_state()
        add_adapters(adapted, SPEC, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)  # the run's own stream is untouched
        inits.append(adapted.get_submodule("model.layers.0.self_attn.q_proj").lora_A
                     ["default"].weight)
    assert torch.equal(inits[0], inits[1]) and not torch.equal(inits[0], inits[2])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_recomputing_plan_gives_the_adapters_plain_gradients(family):
    model, reference = _adapted(family)
    sample = hf_sample()
    want_loss, want = _gradients(reference, sample)
    module = tierflow.fit(model, sample, planner="checkpoint-all")
    assert module.plan.recomputed_stages()
    loss = module(**sample).loss
    loss.backward()
    torch.testing.assert_close(float(loss.detach()), want_loss, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_base_streamed_from_disk_is_never_written_back(tmp_path, family, monkeypatch):
    """Every stage streamed from disk, AdamW inside the backward: the adapters' gradients of
    the first step are plain PyTorch's, three steps end with its adapters, and only adapters
    are written back to the disk tier."""
    model, reference = _adapted(family)
    sample = hf_sample()
    _, want = _gradients(copy.deepcopy(reference), sample)
    module = tierflow.fit(model, sample, optimizer=_adamw, disk=tmp_path,
                          config=FitConfig(planner="checkpoint-all", stream="all",
                                           prefetch_depth=1))
    names = {id(p): name for name, p in model.named_parameters()}
    frozen = {names[id(p)] for ps in module.streamer.stage_params.values() for p in ps
              if not p.requires_grad}
    assert any(".base_layer." in n for n in frozen)  # the projections' base weights stream
    offloaded = module.streamer.offloaded
    written = set()
    write_all = offloaded.write_all
    monkeypatch.setattr(offloaded, "write_all", lambda ps, *after: (
        written.update(names[id(p)] for p in ps), write_all(ps, *after))[1])
    seen = {}

    def keep(p):  # the gradient as it is complete, before the update inside backward
        seen.setdefault(names[id(p)], p.grad.clone())

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(keep)
    train_and_match(module, reference, [sample], _adamw)
    for name, grad in want.items():
        torch.testing.assert_close(seen[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert written and not written & frozen
    assert all(".lora_" in n for n in written)


def test_targets_are_checked_against_the_model():
    assert split_targets(None) == ALL_LINEAR == split_targets("all-linear")
    assert split_targets("q_proj, v_proj") == ("q_proj", "v_proj")
    with pytest.raises(TierflowError, match="empty name"):
        split_targets("q_proj,,v_proj")
    model = tiny_hf("llama")
    with pytest.raises(TierflowError, match="'qkv' names no module of this LlamaForCausalLM: "
                                            "its linear layers are q_proj, k_proj"):
        add_adapters(model, LoraSpec(4, 4.0, 0.0, ("q_proj", "qkv")), seed=0)
    with pytest.raises(TierflowError, match="cannot take LoRA adapters"):
        add_adapters(tiny_hf("llama"), LoraSpec(4, 4.0, 0.0, ("input_layernorm",)), seed=0)
