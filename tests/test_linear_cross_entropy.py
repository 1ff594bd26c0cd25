"""linear_cross_entropy against the un-fused head + Hugging Face's causal-LM loss.

fp32 is compared with torch.testing.assert_close's default tolerances (rtol 1.3e-6, atol 1e-5).
bf16 (autocast, or bf16 parameters) is compared with BF16_TOL: the fused version rounds the
per-chunk weight gradient to bf16 and sums chunks in fp32, where autograd does one bf16 matmul.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tierflow.core.errors import TierflowError
from tierflow.kernels import linear_cross_entropy

loss_utils = pytest.importorskip("transformers.loss.loss_utils")

B, T, H, V = 2, 8, 16, 50  # 16 tokens, 14 scored after the shift
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


def hf_loss(hidden, weight, labels, bias=None, shift=True, ignore_index=-100):
    logits = F.linear(hidden, weight, bias)  # (B, T, V), the full logits
    if shift:
        return loss_utils.ForCausalLMLoss(logits, labels, V, ignore_index=ignore_index)
    return loss_utils.ForCausalLMLoss(logits, None, V, ignore_index=ignore_index,
                                      shift_labels=labels)


def make(seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 3] = -100  # ignored in the middle of a sequence
    labels[1, 5] = -100
    return hidden, weight, b, labels


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 3, 5, 14, 16, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_hf_fp32(chunk, bias):
    hidden, weight, b, labels = make(bias=bias)
    ref = hf_loss(hidden, weight, labels, b)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk)
    assert out.dtype == torch.float32 and out.shape == ()
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads(out, hidden, weight, b), grads(ref, hidden, weight, b)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk", [4, 100])
def test_shift_false_and_custom_ignore_index(chunk):
    hidden, weight, _, labels = make(seed=1)
    for ignore_index, shift in [(-100, False), (7, False), (7, True)]:
        if ignore_index == 7:  # a real class id used as the ignore index
            labels = torch.where(labels == -100, 7, labels)
            labels[0, 0] = 7
        ref = hf_loss(hidden, weight, labels, shift=shift, ignore_index=ignore_index)
        out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, shift=shift,
                                   ignore_index=ignore_index)
        torch.testing.assert_close(out, ref)
        for got, want in zip(grads(out, hidden, weight), grads(ref, hidden, weight)):
            torch.testing.assert_close(got, want)


def test_no_grad_path():
    hidden, weight, b, labels = make(bias=True)
    with torch.no_grad():
        ref = hf_loss(hidden, weight, labels, b)
        out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=3)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, ref)
    # and with nothing requiring grad, grad mode on
    out2 = linear_cross_entropy(hidden.detach(), weight.detach(), labels, bias=b.detach(),
                                chunk_tokens=3)
    assert out2.grad_fn is None
    torch.testing.assert_close(out2, ref)


def test_hidden_without_grad_gives_weight_grads_only():
    hidden, weight, b, labels = make(bias=True)
    hidden = hidden.detach()
    ref = hf_loss(hidden, weight, labels, b)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=5)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads(out, weight, b), grads(ref, weight, b)):
        torch.testing.assert_close(got, want)
    # frozen head (e.g. LoRA): only the hidden gradient
    hidden.requires_grad_()
    weight = weight.detach()
    ref = hf_loss(hidden, weight, labels)
    out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    torch.testing.assert_close(grads(out, hidden)[0], grads(ref, hidden)[0])


def test_tied_embeddings_accumulate():
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()  # embedding == head
    proj = torch.randn(H, H, generator=g).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[1, 2] = -100

    def run(fn):
        hidden = torch.tanh(F.embedding(ids, weight) @ proj)  # (B, T, H), uses weight too
        loss = fn(hidden)
        loss.backward()
        out = (loss.detach(), weight.grad.clone(), proj.grad.clone())
        weight.grad = proj.grad = None
        return out

    want = run(lambda h: hf_loss(h, weight, labels))
    got = run(lambda h: linear_cross_entropy(h, weight, labels, chunk_tokens=3))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_grad_scaling_retain_graph_and_accumulation():
    hidden, weight, _, labels = make()
    ref = hf_loss(hidden, weight, labels)
    want = grads(ref * 3.0, hidden, weight)
    out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    (out * 3.0).backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, want[0])
    torch.testing.assert_close(weight.grad, want[1])
    out.backward()  # second pass on the retained graph: the saved buffers were not mutated
    torch.testing.assert_close(hidden.grad, want[0] * 4 / 3)
    torch.testing.assert_close(weight.grad, want[1] * 4 / 3)


def test_every_label_ignored_matches_hf():
    hidden, weight, b, labels = make(bias=True)
    labels[:] = -100
    ref = hf_loss(hidden, weight, labels, b)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=4)
    assert math.isnan(ref.item()) and math.isnan(out.item())  # HF: 0 / 0
    for got, want in zip(grads(out, hidden, weight, b), grads(ref, hidden, weight, b)):
        torch.testing.assert_close(got, want)  # zeros, not NaN
        assert not got.any()


@pytest.mark.parametrize("chunk", [3, 1000])
def test_bf16_autocast_close_to_autocast_reference(chunk):
    hidden, weight, b, labels = make(seed=4, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = hf_loss(hidden, weight, labels, b)
        out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk)
    want = grads(ref, hidden, weight, b)
    got = grads(out, hidden, weight, b)
    assert [g.dtype for g in got] == [torch.float32] * 3  # the parameters' dtypes, as autograd
    torch.testing.assert_close(out, ref, **BF16_TOL)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, **BF16_TOL)
    # the matmul really ran in bf16: far from the fp32 loss at fp32 tolerance
    assert out.item() != hf_loss(hidden, weight, labels, b).item()


def test_bf16_parameters_without_autocast():
    hidden, weight, _, labels = make(seed=5, dtype=torch.bfloat16)
    ref = hf_loss(hidden, weight, labels)
    out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **BF16_TOL)
    got, want = grads(out, hidden, weight), grads(ref, hidden, weight)
    assert [g.dtype for g in got] == [torch.bfloat16] * 2
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, **BF16_TOL)


def test_saves_only_the_gradients():
    """Memory: the graph keeps grad_hidden and grad_weight, never (tokens, vocab) logits."""
    hidden, weight, _, labels = make()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert sorted(saved) == sorted([tuple(hidden.shape), tuple(weight.shape)])


def test_errors_name_the_problem():
    hidden, weight, _, labels = make()
    bad = labels.clone()
    bad[0, 2] = V
    with pytest.raises(TierflowError, match=f"label {V} is outside"):
        linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(TierflowError, match="labels have shape"):
        linear_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(TierflowError, match="chunk_tokens"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(TierflowError, match="must match"):
        linear_cross_entropy(hidden, weight.detach().bfloat16(), labels)
