"""linear_cross_entropy with final-logit soft-capping against the un-fused head, capped as
Gemma-2 caps it, and Hugging Face's causal-LM loss: fp32 at assert_close's defaults, bf16
autocast within the tolerances of test_linear_cross_entropy.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierflow.core.errors import TierflowError
from tierflow.kernels import linear_cross_entropy

loss_utils = pytest.importorskip("transformers.loss.loss_utils")

B, T, H, V = 2, 8, 16, 50
CAP = 2.0  # small against these logits (|logit| up to about 5): the tanh really bends them
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


def capped_loss(hidden, weight, labels, bias=None):
    logits = F.linear(hidden, weight, bias)  # (B, T, V)
    logits = torch.tanh(logits / CAP) * CAP  # Gemma2ForCausalLM's order of operations
    return loss_utils.ForCausalLMLoss(logits, labels, V)


def make(seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 2] = -100
    return hidden, weight, b, labels


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_softcap_matches_the_capped_head_fp32(chunk, bias):
    hidden, weight, b, labels = make(bias=bias)
    assert F.linear(hidden, weight).abs().max() > 2 * CAP  # the cap is in play
    ref = capped_loss(hidden, weight, labels, b)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk, softcap=CAP)
    torch.testing.assert_close(out, ref)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    for got, want in zip(torch.autograd.grad(out, inputs), torch.autograd.grad(ref, inputs)):
        torch.testing.assert_close(got, want)
    uncapped = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk)
    assert not torch.allclose(uncapped, ref)


def test_softcap_under_bf16_autocast_is_close():
    hidden, weight, _, labels = make(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, softcap=CAP)
    ref = capped_loss(hidden, weight, labels)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    got = torch.autograd.grad(out, [hidden, weight])
    want = torch.autograd.grad(ref, [hidden, weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-3)


def test_softcap_must_be_positive():
    hidden, weight, _, labels = make()
    with pytest.raises(TierflowError, match="softcap=0"):
        linear_cross_entropy(hidden, weight, labels, softcap=0)
