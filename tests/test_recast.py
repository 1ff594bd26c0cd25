"""Weight casts left out of the tape under bf16 autocast (exec/recast.py): made again in
backward from the weights, they give the same bits as the saved casts, the tape shrinks by
exactly their bytes, and training with streamed weights and tapes on disk is plain PyTorch's."""
import copy
import functools

import pytest
import torch
from models import hf_sample, tiny_hf
from side_by_side import gathered_parameters
from torch import nn

import tierflow
from tierflow.chain import to_chain
from tierflow.core.config import FitConfig
from tierflow.exec.context import AutocastMode
from tierflow.exec.recast import weight_cast
from tierflow.exec.stage_call import (
    backward_taped,
    forward_plain,
    forward_taped,
    storage_key,
    tape_bytes,
)

BF16 = AutocastMode("cpu", True, torch.bfloat16)


def _plain_forward(stage, x, ctx, params):
    """A plain autograd forward of ``stage`` under bf16 autocast: its input leaf, its output
    and the bytes of what it saves beyond the parameters, the input and the output."""
    saved = {}

    def pack(t):
        saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    xin = x.detach().requires_grad_(True)
    with torch.enable_grad(), BF16(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = stage(xin, ctx)
    held = {storage_key(t) for t in [xin, y, *params]}
    return xin, y, sum(n for key, n in saved.items() if key not in held)


def _taped_like_plain(stage, x, ctx, trained, held):
    """``stage`` run by ``forward_taped`` and by plain autograd under bf16 autocast: the
    outputs, the input gradients and the gradients of ``trained`` must be equal bit for bit.
    Returns how many bytes less than plain autograd the tape holds (beyond ``held``, the
    input and the output) and the output."""
    xin, y_plain, plain_tape = _plain_forward(stage, x, ctx, held)
    grad_y = torch.randn_like(y_plain)
    expected = torch.autograd.grad(y_plain, [xin, *trained], grad_y)
    taped = forward_taped(stage, x, ctx, BF16, input_grad=True)
    less = plain_tape - tape_bytes(taped, {storage_key(p) for p in held})
    assert torch.equal(taped.y, y_plain)
    assert torch.equal(backward_taped(taped, grad_y), expected[0])
    for p, want in zip(trained, expected[1:]):
        assert torch.equal(p.grad, want)
        p.grad = None
    return less, y_plain.detach()


def _decoder_layers(family):
    """The decoder-layer stages of a tiny ``family`` model and the first one's input."""
    model = tiny_hf(family, layers=2)
    sample = hf_sample(labels=False)
    chain = to_chain(model, sample)
    x, ctx = chain.split_inputs(**sample)
    return chain.stages[1:-1], forward_plain(chain.stages[0], x, ctx, BF16), ctx


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_a_layer_recasts_its_weights_to_the_same_bits(family):
    """Each decoder layer: the tape holds everything autograd saves but the bf16 copies of
    its matmul weights (2 bytes per weight element), and the output, the input gradient and
    every weight gradient equal plain autograd's bit for bit."""
    stages, x, ctx = _decoder_layers(family)
    for stage in stages:
        params = [p for p in stage.parameters() if p.requires_grad]
        less, x = _taped_like_plain(stage, x, ctx, params, params)
        assert less == 2 * sum(p.numel() for p in params if p.dim() == 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_casts_of_frozen_weights_are_recast_too(family):
    """Adapter-style fine-tuning: with the matmul weights frozen (``requires_grad=False``)
    their bf16 casts carry no autograd history, yet the tape leaves them out as well (2 bytes
    per weight element), and the output, the input gradient and the gradients of the weights
    still trained (the norms) equal plain autograd's bit for bit."""
    stages, x, ctx = _decoder_layers(family)
    for stage in stages:
        for p in stage.parameters():
            p.requires_grad_(p.dim() != 2)  # matmul weights frozen, norms and biases trained
        trained = [p for p in stage.parameters() if p.requires_grad]
        less, x = _taped_like_plain(stage, x, ctx, trained, list(stage.parameters()))
        assert less == 2 * sum(p.numel() for p in stage.parameters() if p.dim() == 2)


class _Scaled(nn.Module):
    """A weight cast, then scaled: the saved product is not a cast."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ (self.weight.to(torch.bfloat16) * 2).t()


def test_only_plain_casts_of_the_stage_weights_are_recast():
    layer = _Scaled()
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)  # its fp32 copy: no weight
    ours = {id(layer.weight)}
    seen = []

    def pack(t):
        seen.append((weight_cast(t, ours), weight_cast(t, set())))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)  # saves the scaled cast
        x.float() @ layer.weight.t()  # fp32: saves the weight itself, not a cast
        cast = layer.weight.to(torch.bfloat16)
        x @ cast.t()  # a plain cast: recast, if the weight is the stage's
    assert [a is not None for a, _ in seen].count(True) == 1
    assert all(b is None for _, b in seen)
    recast = next(a for a, _ in seen if a is not None)
    assert torch.equal(recast.tensor(), cast.t())
    assert recast.tensor().stride() == cast.t().stride()


class _CastThenChanged(nn.Module):
    """A frozen weight cast, then changed in place: what is saved is not a cast any more."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x, ctx=None):
        cast = self.weight.to(torch.bfloat16)
        return x @ cast.mul_(2).t()


def test_a_frozen_weight_cast_changed_in_place_stays_in_the_tape():
    layer = _CastThenChanged()
    x = torch.randn(4, 8)
    taped = forward_taped(layer, x, {}, BF16, input_grad=True)
    assert tape_bytes(taped, {storage_key(layer.weight)}) == 8 * 8 * 2  # the changed copy
    grad = backward_taped(taped, torch.ones_like(taped.y))
    xin = x.clone().requires_grad_(True)
    with BF16():
        (xin @ (layer.weight.to(torch.bfloat16) * 2).t()).backward(torch.ones(4, 8))
    assert torch.equal(grad, xin.grad)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streamed_weights_and_disk_tapes_under_autocast_train_like_plain_pytorch(
        tmp_path, family, monkeypatch):
    """Every stage streamed from disk and its tape offloaded there, under bf16 autocast with
    dropout: every weight of the decoder layers is recast in backward (its weights are read
    back for it), and 3 SGD steps give plain PyTorch's losses and parameters (the fused LM
    head rounds its bf16 logits' sums in another order: rtol 1e-3, and atol 1e-3 after lr 0.1
    steps; AdamW would turn those roundings of near-zero gradients into lr-sized steps)."""
    from tierflow.exec import stage_call
    from tierflow.exec import tapes as tapes_module

    monkeypatch.setattr(tapes_module, "MIN_BYTES", 1)
    recast = set()
    original = stage_call.weight_cast

    def noting(t, params, frozen=None):
        cast = original(t, params, frozen)
        if cast is not None:
            recast.add(id(cast.param))
        return cast

    monkeypatch.setattr(stage_call, "weight_cast", noting)
    model = tiny_hf(family, layers=3, dropout=0.1)
    reference = copy.deepcopy(model)
    sample = hf_sample()

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    with autocast():
        module = tierflow.fit(model, sample, optimizer=sgd, disk=tmp_path,
                              config=FitConfig(planner="keep-all", offload_tapes="all",
                                               stream="all", prefetch_depth=1))
    plain = sgd(reference.parameters())
    for step in range(3):
        # one autocast region per forward: within one, autocast would reuse its casts of the
        # weights from before the update (its weight-cast cache)
        torch.manual_seed(step)
        with autocast():
            loss = module(**sample).loss
        loss.backward()
        torch.manual_seed(step)
        with autocast():
            expected = reference(**sample).loss
        expected.backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0.0,
                                   msg=lambda m, s=step: f"step {s}: {m}")
    layers = [p for stage in module.chain.stages[1:-1] for p in stage.parameters()]
    assert {id(p) for p in layers if p.dim() == 2} <= recast
    ours = gathered_parameters(module)
    for name, theirs in reference.named_parameters():
        torch.testing.assert_close(ours[name], theirs.detach(), rtol=0.0, atol=1e-3,
                                   msg=lambda m, n=name: f"{n}: {m}")
