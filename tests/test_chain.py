"""to_chain: a chain's plain run gives the model's own outputs, losses and gradients, with the
same dropout masks, and its stages hold the model's own parameters."""
from __future__ import annotations

import pytest
import torch
from models import (
    CORE_FAMILIES,
    HF_FAMILIES,
    hf_sample,
    mlp_sample,
    residual_mlp,
    resnet_cnn,
    resnet_sample,
    sequential_mlp,
    tiny_hf,
)
from torch import nn

from tierflow.chain import ChainError, call_args, stateful_modules, to_chain


def _run(model: nn.Module, fn, seed: int = 1):
    """fn() under a fixed seed -> (output, grad of every parameter); BN buffers restored after."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = fn()
    value = out.loss if hasattr(out, "loss") and out.loss is not None else out
    value = value if isinstance(value, torch.Tensor) else out.logits
    (value.float() * torch.linspace(0.5, 1.5, value.numel()).view_as(value)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    new_buffers = [b.clone() for b, _ in buffers]
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    model.zero_grad(set_to_none=True)
    return value.detach(), grads, new_buffers


def _assert_same(model: nn.Module, reference, chained) -> None:
    ref_value, ref_grads, ref_buffers = reference
    value, grads, buffers = chained
    torch.testing.assert_close(value, ref_value)
    names = [n for n, _ in model.named_parameters()]
    for name, g, ref in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, ref, msg=lambda m: f"grad of {name}: {m}")
    for b, ref in zip(buffers, ref_buffers):  # BatchNorm running stats updated once, the same
        torch.testing.assert_close(b, ref)


def _check(model: nn.Module, sample, chain=None) -> None:
    chain = chain or to_chain(model, sample)
    args, kwargs = call_args(sample)
    reference = _run(model, lambda: model(*args, **kwargs))
    _assert_same(model, reference, _run(model, lambda: chain.run(*args, **kwargs)))
    # Every stage holds the model's own Parameters, and together they hold all of them.
    own = {id(p) for p in model.parameters()}
    held = [id(p) for stage in chain.stages for p in stage.parameters()]
    assert set(held) == own


# ---------------------------------------------------------------------------- nn.Sequential


def test_sequential_mlp_with_dropout():
    model = sequential_mlp(dropout=0.2)
    chain = to_chain(model, mlp_sample())
    assert chain.names == ["0-2", "3-5", "6-8", "9"]  # ReLU and Dropout fold into the Linear
    assert chain.signatures[1] == chain.signatures[2] != chain.signatures[0]
    _check(model, mlp_sample(), chain)
    assert chain.run(input=mlp_sample()).shape == (8, 8)


# ---------------------------------------------------------------------------- torch.fx


def test_fx_resnet_cnn():
    model = resnet_cnn(dropout=0.2)
    chain = to_chain(model, resnet_sample())
    assert chain.names == ["stem..bn", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"]
    assert chain.signatures[1] == chain.signatures[2]  # identical blocks, different names
    assert len(set(chain.signatures)) == 5
    assert stateful_modules(chain.stages[1]) and not stateful_modules(chain.stages[-1])
    _check(model, resnet_sample(), chain)


def test_fx_residual_mlp_with_dropout():
    model = residual_mlp(dropout=0.2)
    chain = to_chain(model, mlp_sample())
    assert len(chain) == 5 and chain.names[0] == "in_proj" and chain.names[-1] == "out_proj"
    assert chain.signatures[1] == chain.signatures[2]
    _check(model, mlp_sample(), chain)


class _SideInputs(nn.Module):
    """A learned table and a second argument read by every block: they travel in ctx."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16))
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, scale, shift=0.5):
        bias = self.pos * scale + shift  # does not depend on x: recomputed in each stage
        for block in self.blocks:
            x = torch.tanh(block(x) + bias)
        return x


def test_fx_side_inputs_travel_in_ctx():
    torch.manual_seed(0)
    model = _SideInputs()
    sample = {"x": mlp_sample(), "scale": torch.tensor(2.0)}
    chain = to_chain(model, sample)
    assert len(chain) == 3
    x, ctx = chain.split_inputs(**sample)
    assert x is sample["x"] and set(ctx) == {"scale", "shift"}
    _check(model, sample, chain)
    _check(model, (mlp_sample(), torch.tensor(2.0), 0.1), chain)  # positional, other default


# ---------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hf_causal_lm_loss_and_logits(family):
    model = tiny_hf(family, dropout=0.1)  # train mode, dropout on
    sample = hf_sample()
    chain = to_chain(model, sample)
    layers = len(chain) - 2
    assert chain.names == ["embed", *[f"layers.{i}" for i in range(layers)], "head"]
    assert len(set(chain.signatures[1:-1])) == 1  # identical decoder layers: one signature
    _check(model, sample, chain)  # the loss with labels, through the fused head + loss
    _check(model, {"input_ids": sample["input_ids"]}, chain)  # the logits without labels
    out = chain.run(**sample)
    assert out.logits is None and out.loss.ndim == 0
    # Stages own disjoint parameters, except a head tied to the embeddings.
    per_stage = [{id(p) for p in stage.parameters()} for stage in chain.stages]
    shared = set.intersection(per_stage[0], per_stage[-1])
    assert shared == ({id(model.get_output_embeddings().weight)}
                      if model.config.tie_word_embeddings else set())
    assert sum(len(s) for s in per_stage) == len(list(model.parameters())) + len(shared)


def test_hf_gpt2_dropout_matters_and_split_draws_no_random_numbers():
    model = tiny_hf("gpt2", dropout=0.2, layers=3)
    sample = hf_sample()
    chain = to_chain(model, sample)
    with torch.no_grad():
        train_loss = chain.run(**sample).loss
        eval_loss = chain.run(**sample).loss if model.eval() else None
    model.train()
    assert not torch.allclose(train_loss, eval_loss)  # the masks are really in play
    state = torch.get_rng_state()
    chain.split_inputs(**sample)
    assert torch.equal(state, torch.get_rng_state())


def test_hf_positional_and_attention_mask():
    model = tiny_hf("llama")
    ids = hf_sample()["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    chain = to_chain(model, ids)
    _check(model, (ids, mask), chain)
    _check(model, {"input_ids": ids, "attention_mask": mask, "labels": ids})


# ---------------------------------------------------------------------------- errors


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else x


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_unchainable_models_raise_chain_error():
    x = torch.randn(2, 4)
    with pytest.raises(ChainError, match="_DataDependent cannot be traced by torch.fx"):
        to_chain(_DataDependent(), x)
    with pytest.raises(ChainError, match="_TwoHeads has no articulation point"):
        to_chain(_TwoHeads(), x)
    assert issubclass(ChainError, TypeError)


def test_hf_soft_capped_head_is_fused():
    """Gemma-2's final-logit soft-capping runs inside the fused head's chunks: the model's
    loss, logits and gradients."""
    import transformers

    from tierflow.chain.hf_head import FusedHead

    config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                       final_logit_softcapping=0.5)  # small: it bends
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    sample = hf_sample()
    chain = to_chain(model, sample)
    assert isinstance(chain.stages[-1], FusedHead) and chain.stages[-1].softcap == 0.5
    _check(model, sample, chain)
    _check(model, {"input_ids": sample["input_ids"]}, chain)


def test_hf_refusal_names_the_family():
    import transformers

    from tierflow.chain.base import UnsupportedModelError
    from tierflow.core.errors import TierflowError

    config = transformers.XLMConfig(vocab_size=128, emb_dim=32, n_layers=2, n_heads=4,
                                    dropout=0.1, causal=True)
    model = transformers.XLMWithLMHeadModel(config).train()
    with pytest.raises(UnsupportedModelError, match=r"^model type 'xlm' \(XLMWithLMHeadModel\) "
                       "cannot be trained exactly by tierflow: it draws random numbers between "
                       "decoder layers") as refusal:
        to_chain(model, hf_sample())
    assert isinstance(refusal.value, TierflowError) and "\n" not in str(refusal.value)


def test_core_families_are_covered():
    assert set(CORE_FAMILIES) <= set(HF_FAMILIES)


def test_fx_chain_refuses_the_other_mode_when_tracing_fixed_self_training():
    model = residual_mlp(dropout=0.2)  # F.dropout(y, p, self.training): fixed when traced
    chain = to_chain(model, mlp_sample())
    model.eval()
    with pytest.raises(ChainError, match="chained in train mode"):
        chain.run(mlp_sample())
    resnet = resnet_cnn().eval()  # modules only: the chain follows model.train()/eval()
    chain = to_chain(resnet, resnet_sample())
    resnet.train()
    _check(resnet, resnet_sample(), chain)


def test_hf_fused_head_under_bf16_autocast_is_checked_at_bf16_tolerance():
    """Under bf16 autocast the fused head's chunked logits and the model's own round apart:
    for tinyllama-1.1b's shapes (one decoder layer, zero ids as the trainer plans with) the
    embedding gradients differ by 0.7% of their size, above float32's 0.1%, and the head
    fell back to the model's own (full logits, and another plan than a disk-tier run of the
    same model, which skips the gradient check). At bf16's 1% it is the fused head."""
    import copy

    from tierflow.chain.hf_head import FusedHead
    from tierflow.models.load import build_random
    from tierflow.sim.shapes import model_config

    config = copy.deepcopy(model_config("tinyllama-1.1b"))
    config.num_hidden_layers = 1
    model = build_random(config, dtype=torch.float32, seed=0)
    window = torch.zeros(2, 9, dtype=torch.long)  # (batch, seq + 1)
    sample = {"input_ids": window[:, :-1], "shift_labels": window[:, 1:]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chain = to_chain(model, sample)
    assert isinstance(chain.stages[-1], FusedHead)
