"""Fused, chunked LM head + cross-entropy: the (tokens, vocab) logits never exist in full.

``linear_cross_entropy(hidden, weight, labels)`` returns the same scalar as

    logits = F.linear(hidden, weight, bias)                     # (B, T, V)
    transformers.loss.loss_utils.ForCausalLMLoss(logits, labels, V)

(labels shifted left by one and padded with ``ignore_index``, logits upcast to float32, mean
over the tokens whose label is not ignored; NaN when every label is ignored), but it walks the
tokens in chunks of ``chunk_tokens`` rows. For each chunk it computes the logits, the loss and,
right away, the gradient of the mean loss with respect to the logits, which it contracts into
the gradients of ``hidden``, ``weight`` and ``bias``. Those gradients are the only thing the
autograd graph keeps; backward just scales them by the incoming gradient.

With ``softcap`` (final-logit soft-capping, Gemma-2 and others) the loss is taken on
``softcap * tanh(logits / softcap)``, computed per chunk in float32, and the gradient goes back
through the tanh.

Extra memory: O(chunk_tokens * vocab) for one chunk's logits (buffers that every chunk
reuses), plus a gradient buffer shaped like ``hidden`` and one shaped like ``weight`` (float32
while accumulating over chunks when the matmul runs in bf16/fp16, then cast to
``weight.dtype``).

Rows whose label is ``ignore_index`` (the last position of every sequence when ``shift=True``,
masked prompt tokens) are skipped: they contribute neither loss nor gradient, so their logits
are never computed. Finding them costs one host synchronisation on CUDA.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..core.errors import TierflowError

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
    shift: bool = True,
    softcap: float | None = None,
) -> Tensor:
    """Mean causal-LM cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``.

    hidden: (..., T, h) final hidden states; weight: (V, h) LM head; labels: (..., T) token ids,
    ``ignore_index`` where no loss is wanted; bias: (V,) or None.
    shift=True predicts ``labels[..., t + 1]`` from position t (Hugging Face causal LMs);
    shift=False uses ``labels`` as given (already-shifted labels).
    softcap: the logits become ``softcap * tanh(logits / softcap)`` before the loss (None: as
    they are).
    Under an active autocast the matmuls run in the autocast dtype, as ``nn.Linear`` would.
    Returns a float32 scalar.
    """
    _check_inputs(hidden, weight, labels, bias, chunk_tokens, softcap)
    compute_dtype = _compute_dtype(hidden, weight)
    targets = labels.to(device=hidden.device, dtype=torch.long)  # (..., T)
    if shift:
        # position t predicts token t + 1; the last position of each sequence predicts nothing
        targets = F.pad(targets, (0, 1), value=ignore_index)[..., 1:]  # (..., T)
    targets = targets.reshape(-1)  # (N,)

    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not wants_grad:
        loss, _, _, _ = _loss_and_grads(hidden, weight, bias, targets, chunk_tokens, ignore_index,
                                        compute_dtype, (False, False, False), softcap)
        return loss
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens, ignore_index,
                                     compute_dtype, softcap)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the gradients; backward scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, ignore_index, compute_dtype,
                softcap):
        needs = tuple(ctx.needs_input_grad[:3])  # (hidden, weight, bias)
        loss, grad_hidden, grad_weight, grad_bias = _loss_and_grads(
            hidden, weight, bias, targets, chunk_tokens, ignore_index, compute_dtype, needs,
            softcap)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = list(ctx.saved_tensors)  # grad_hidden, grad_weight, grad_bias (or None)
        # d(out)/d(loss) is almost always exactly 1: hand the buffers over without a copy
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            grads = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return grads[0], grads[1], grads[2], None, None, None, None, None


def _loss_and_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                    chunk_tokens: int, ignore_index: int, compute_dtype: torch.dtype,
                    needs: tuple[bool, bool, bool], softcap: float | None = None):
    """The chunk loop. Returns (loss, grad_hidden, grad_weight, grad_bias), grads None unless needed."""
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    any_grad = need_h or need_w or need_b
    vocab, h = weight.shape
    hidden_flat = hidden.reshape(-1, h)  # (N, h)
    n_tokens = hidden_flat.shape[0]
    device = hidden.device

    rows = (targets != ignore_index).nonzero().squeeze(1)  # (n_valid,) indices of scored tokens
    n_valid = rows.numel()  # one host sync on CUDA
    if n_valid:
        lo, hi = torch.aminmax(targets.index_select(0, rows))
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise TierflowError(
                f"label {bad} is outside the vocabulary [0, {vocab}) of a weight of shape "
                f"{tuple(weight.shape)}; use ignore_index={ignore_index} for tokens to skip")
    inv_n = 1.0 / max(n_valid, 1)  # d(mean)/d(row loss); all-ignored: loss NaN, grads 0 (as HF)
    n_chunks = math.ceil(n_valid / chunk_tokens)
    low = compute_dtype in _LOW_PRECISION
    # accumulate the weight/bias gradients over chunks in fp32 when the matmuls are bf16/fp16
    acc_dtype = torch.float32 if low else compute_dtype

    grad_hidden = grad_weight = grad_bias = None
    with torch.autocast(device.type, enabled=False):  # we cast explicitly below
        w_c = weight.to(compute_dtype)  # (V, h); a copy only under autocast
        b_c = None if bias is None else bias.to(compute_dtype)  # (V,)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        if need_h:
            grad_hidden = torch.zeros((n_tokens, h), dtype=hidden.dtype, device=device)  # (N, h)
        if need_w and n_chunks > 1:
            grad_weight = torch.empty((vocab, h), dtype=acc_dtype, device=device)  # (V, h)
            # low precision: each chunk's product lands here, then is added in fp32
            gw_chunk = torch.empty((vocab, h), dtype=compute_dtype, device=device) if low else None
        if need_b:
            grad_bias = torch.zeros((vocab,), dtype=torch.float32, device=device)  # (V,)
        # one chunk's logits, reused by every chunk: fresh (c, V) blocks per chunk cost a page
        # fault per page on CPU, more than the elementwise work on them
        c = min(chunk_tokens, n_valid)
        logits32 = torch.empty((c, vocab), dtype=torch.float32, device=device)  # (c, V)
        logits_low = torch.empty((c, vocab), dtype=compute_dtype, device=device) \
            if low else logits32  # (c, V) what the matmul writes
        grad_low = torch.empty_like(logits_low) if low and any_grad else logits32  # (c, V)
        # tanh(logits / softcap) of the chunk, kept for the gradient through the cap
        squashed = torch.empty((c, vocab), dtype=torch.float32, device=device) \
            if softcap is not None else None  # (c, V)

        for start in range(0, n_valid, chunk_tokens):
            r = rows[start:start + chunk_tokens]  # (n,)
            n = r.numel()
            t_c = targets.index_select(0, r)  # (n,)
            h_c = hidden_flat.index_select(0, r).to(compute_dtype)  # (n, h)
            if b_c is None:
                torch.mm(h_c, w_c.t(), out=logits_low[:n])  # (n, V) in compute dtype
            else:
                torch.addmm(b_c, h_c, w_c.t(), out=logits_low[:n])  # (n, V)
            z = logits32[:n]  # (n, V) fp32, as HF upcasts before the loss
            if low:
                z.copy_(logits_low[:n])
            if squashed is not None:  # z = softcap * tanh(z / softcap), as the model does it
                t = torch.div(z, softcap, out=squashed[:n]).tanh_()  # (n, V)
                torch.mul(t, softcap, out=z)
            target_logit = z.gather(1, t_c[:, None]).squeeze(1)  # (n,)
            top = z.amax(dim=1)  # (n,)
            z.sub_(top[:, None]).exp_()  # (n, V) exp(logits - max)
            total = z.sum(dim=1)  # (n,)
            loss_sum += (top + total.log() - target_logit).sum()  # logsumexp - target logit
            if not any_grad:
                continue

            # d(mean loss)/d(logits) = (softmax - onehot) / n_valid, built in place in `z`
            probs = z.mul_((inv_n / total)[:, None])  # (n, V) softmax / n_valid
            probs.scatter_add_(1, t_c[:, None], probs.new_full((n, 1), -inv_n))
            if squashed is not None:  # through the cap: d z / d logits = 1 - tanh^2
                probs.mul_(t.square_().neg_().add_(1.0))
            if need_b:
                grad_bias += probs.sum(0)  # (V,)
            g = grad_low[:n]  # (n, V), as autograd casts it back through .float()
            if low:
                g.copy_(probs)
            if need_h:
                gh_c = torch.mm(g, w_c)  # (n, h)
                grad_hidden.index_copy_(0, r, gh_c.to(hidden.dtype))
            if need_w:
                if n_chunks == 1:
                    grad_weight = torch.mm(g.t(), h_c)  # (V, h), exactly what autograd does
                elif not low:
                    if start == 0:
                        torch.mm(g.t(), h_c, out=grad_weight)  # (V, h)
                    else:
                        grad_weight.addmm_(g.t(), h_c)  # (V, h)
                else:
                    torch.mm(g.t(), h_c, out=gw_chunk)  # (V, h)
                    if start == 0:
                        grad_weight.copy_(gw_chunk)
                    else:
                        grad_weight += gw_chunk
        del logits32, logits_low, grad_low, squashed

        loss = loss_sum / n_valid if n_valid else loss_sum / 0.0  # 0/0 = NaN, like HF

        if need_h:
            grad_hidden = grad_hidden.view(hidden.shape)  # (..., T, h)
        if need_w:
            if grad_weight is None:  # nothing scored
                grad_weight = torch.zeros_like(weight)
            grad_weight = grad_weight.to(weight.dtype)  # (V, h)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)  # (V,)
    return loss, grad_hidden, grad_weight, grad_bias


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype `nn.Linear` would multiply in: the autocast dtype if one is active."""
    dev = hidden.device.type
    if (torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
            and hidden.dtype in _AUTOCAST_ELIGIBLE and weight.dtype in _AUTOCAST_ELIGIBLE):
        return torch.get_autocast_dtype(dev)
    if hidden.dtype != weight.dtype:
        raise TierflowError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; outside autocast they must "
            f"match: cast one of them, or run under torch.autocast")
    return hidden.dtype


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                  chunk_tokens: int, softcap: float | None) -> None:
    if hidden.dim() < 2:
        raise TierflowError(f"hidden has shape {tuple(hidden.shape)}; expected (..., seq, hidden)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise TierflowError(
            f"weight has shape {tuple(weight.shape)}; expected (vocab, {hidden.shape[-1]}) to "
            f"match hidden of shape {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise TierflowError(
            f"labels have shape {tuple(labels.shape)}; expected {tuple(hidden.shape[:-1])}, "
            f"hidden's shape without its last dimension")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TierflowError(f"labels are {labels.dtype}; expected integer token ids")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise TierflowError(
            f"bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},), one per vocab row")
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise TierflowError(f"chunk_tokens={chunk_tokens!r}; expected a positive int such as 1024")
    if softcap is not None and not softcap > 0:
        raise TierflowError(f"softcap={softcap!r}; expected a positive number (None: no cap)")
