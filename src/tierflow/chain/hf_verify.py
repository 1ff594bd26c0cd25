"""Does a chain compute what its Hugging Face causal LM computes? Checked on a probe (one
sequence of the sample, at most 8 tokens) before any step:

- the logits (eval mode), the loss with the probe as labels, and with the probe shifted as
  ``shift_labels`` (as ``tierflow train`` gives them);
- the loss in training mode, both runs from one seed: dropout masks and other random draws
  replayed as the model makes them;
- the loss's gradient with respect to the input embeddings' output: what flows back through
  every stage, side inputs and states between layers included. The parameters are frozen
  meanwhile, so no gradient the size of the model is made. Not for a model whose weights are
  fetched per call (a disk tier's, their storages empty meanwhile): the backward would need
  all of them in memory at once.

The model's own values (``Reference``) are computed once; a model whose own loss fails on the
probe is refused here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .base import Chain, UnsupportedModelError
from .hf_head import FusedHead
from .hf_inputs import model_mode, rng_devices


@dataclass
class Reference:
    logits: torch.Tensor  # eval mode
    loss: torch.Tensor | None  # eval mode, labels = the probe (None: the input is embeddings)
    shift_loss: torch.Tensor | None  # eval mode, shift_labels (None: the model takes none)
    train_loss: torch.Tensor | None  # training mode, from seed 0
    gradient: torch.Tensor | None  # d loss / d embeddings' output, eval mode (None: no input
    # embeddings module, or weights fetched per call)


def reference(model: nn.Module, input_key: str, tiny: torch.Tensor,
              logits: torch.Tensor) -> Reference:
    """The model's own values on the probe (``logits``: its eval-mode logits, already made)."""
    if input_key != "input_ids":
        return Reference(logits, None, None, None, None)
    try:
        with torch.no_grad(), model_mode(model, False):
            loss = model(input_ids=tiny, labels=tiny, use_cache=False).loss
            try:  # as the chain calls the model's own loss code with shift_labels alone
                shifted = _shifted(tiny)
                shift_loss = model(input_ids=tiny, labels=shifted, shift_labels=shifted,
                                   use_cache=False).loss
            except TypeError:  # its forward takes no shift_labels
                shift_loss = None
        with torch.no_grad(), torch.random.fork_rng(devices=rng_devices(tiny)), \
                model_mode(model, True):
            torch.manual_seed(0)
            train_loss = model(input_ids=tiny, labels=tiny, use_cache=False).loss
        checkable = _input_embeddings(model) is not None and not _fetched_per_call(model)
        gradient = _embedding_gradient(
            model, lambda: model(input_ids=tiny, labels=tiny, use_cache=False)) \
            if checkable else None
    except Exception as e:  # noqa: BLE001 - the family's own failure is the reason
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise UnsupportedModelError(model, "its own loss fails on one sequence of the sample "
                                    f"({type(e).__name__}: {first})") from e
    return Reference(logits, loss, shift_loss, train_loss, gradient)


def _shifted(tiny: torch.Tensor) -> torch.Tensor:
    """The probe as shift_labels: position t's target is token t + 1, none for the last."""
    return torch.cat([tiny[:, 1:], torch.full_like(tiny[:, :1], -100)], dim=1)


def verify(model: nn.Module, chain: Chain, input_key: str, tiny: torch.Tensor,
           ref: Reference) -> str:
    """"" when the chain gives the model's values on ``tiny``, else what differs."""
    try:
        return _compare(model, chain, input_key, tiny, ref)
    except Exception as e:  # noqa: BLE001 - any failure of the chain on the probe is the reason
        return f"the chain fails on it: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _compare(model: nn.Module, chain: Chain, input_key: str, tiny: torch.Tensor,
             ref: Reference) -> str:
    exact = next(model.parameters()).dtype == torch.float32
    tolerance = {} if exact else dict(rtol=1e-3, atol=1e-3)
    with torch.no_grad(), model_mode(model, False):
        got = chain.run(**{input_key: tiny}).logits
    if got.shape != ref.logits.shape:
        return (f"its head gives logits of shape {tuple(ref.logits.shape)}, the chain "
                f"{tuple(got.shape)}")
    if not _close(got, ref.logits, tolerance):
        diff = (got.float() - ref.logits.float()).abs().max().item()
        return (f"the chained logits differ from the model's by up to {diff:.3g}: its forward "
                "does something between the layers or after the body that a chain does "
                "not reproduce")
    if ref.loss is None:
        return ""
    with torch.no_grad(), model_mode(model, False):
        loss = chain.run(input_ids=tiny, labels=tiny).loss
    if not _close(loss.float(), ref.loss.float(), tolerance):
        return f"the chained loss {loss.item():.6g} differs from the model's {ref.loss.item():.6g}"
    if ref.shift_loss is not None and not isinstance(chain.stages[-1], FusedHead):
        # the fused head reads shift_labels by construction; the model's own code, as given
        with torch.no_grad(), model_mode(model, False):
            loss = chain.run(input_ids=tiny, shift_labels=_shifted(tiny)).loss
        if not _close(loss.float(), ref.shift_loss.float(), tolerance):
            return (f"with shift_labels the chained loss {loss.item():.6g} differs from the "
                    f"model's {ref.shift_loss.item():.6g}")
    with torch.no_grad(), torch.random.fork_rng(devices=rng_devices(tiny)), \
            model_mode(model, True):  # dropout on: the same draws, the same masks
        torch.manual_seed(0)
        loss = chain.run(input_ids=tiny, labels=tiny).loss
    if not _close(loss.float(), ref.train_loss.float(), tolerance):
        return (f"in training mode the chained loss {loss.item():.6g} differs from the "
                f"model's {ref.train_loss.item():.6g}: it draws random numbers in a way a "
                "chain does not replay")
    if ref.gradient is None:
        return ""
    got = _embedding_gradient(model, lambda: chain.run(input_ids=tiny, labels=tiny))
    scale = ref.gradient.nan_to_num(posinf=0.0, neginf=0.0).abs().max().item()
    # a missing path differs by the gradient's own size; rounding by far less (NaN where the
    # model's own gradient is NaN: Gemma-3n's magnitude sqrt at a zero vector): a thousandth
    # of it in float32, a hundredth where the matmuls round to 16 bits (bf16 autocast: the
    # fused head's chunked logits and the model's own ones round apart, by 0.7% of the
    # gradient's size for tinyllama-1.1b's first layer)
    share = 1e-3 if exact and not _autocast_16bit(tiny.device.type) else 1e-2
    if not _close(got, ref.gradient, dict(rtol=share, atol=share * scale, equal_nan=True)):
        diff = (got - ref.gradient).nan_to_num().abs().max().item()
        return (f"the chained loss's gradient differs from the model's by up to {diff:.3g} "
                f"(of {scale:.3g}): something passes between its layers that a chain does "
                "not carry")
    return ""


def _autocast_16bit(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` with a 16-bit dtype."""
    return torch.is_autocast_enabled(device_type) and \
        torch.get_autocast_dtype(device_type) in (torch.bfloat16, torch.float16)


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: dict) -> bool:
    try:
        torch.testing.assert_close(got, want, **tolerance)
    except AssertionError:
        return False
    return True


def _fetched_per_call(model: nn.Module) -> bool:
    """Whether some of the model's weights are held elsewhere and fetched as it runs."""
    return any(p.numel() and p.untyped_storage().nbytes() == 0 for p in model.parameters())


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    try:
        return model.get_input_embeddings()
    except NotImplementedError:
        return None


def _embedding_gradient(model: nn.Module, run: Callable[[], Any]) -> torch.Tensor:
    """d loss / d the input embeddings' output, eval mode, the parameters frozen: summed over
    the embeddings' calls, of which the loss uses one (a chain also calls them, without grad,
    to find the layers' side inputs)."""
    leaves: list[torch.Tensor] = []

    def as_leaf(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        leaf = output.detach().requires_grad_()
        leaves.append(leaf)
        return leaf.clone()  # the model may scale it in place (CTRL)

    trainable = [p for p in model.parameters() if p.requires_grad]
    handle = _input_embeddings(model).register_forward_hook(as_leaf)
    for p in trainable:
        p.requires_grad_(False)
    try:
        with torch.enable_grad(), model_mode(model, False):
            loss = run().loss
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    finally:
        handle.remove()
        for p in trainable:
            p.requires_grad_(True)
    return sum(g for g in grads if g is not None)
