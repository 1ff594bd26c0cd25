"""Applying a ``PrecisionConfig`` to a built model, its autocast and its optimizer, and
checking first that the device can run it (``check_device``: one tiny matmul per device type
and dtype, cached for the process).

``apply_precision`` is a module swap in the style of gpt-fast's quantization: the model's code
(Hugging Face or not) never learns about it. Which Linears become fp8:

- a Hugging Face causal LM: every ``nn.Linear`` inside the decoder layers (attention
  projections and MLP), found as ``tierflow.chain.hf`` finds them. The embeddings (a lookup,
  not a matmul) and the LM head stay bf16 under autocast, as in llm.q: the head's output is
  the logits, whose small differences the softmax turns into the loss, and tierflow's fused
  head + loss reads the head's weight directly;
- any other model: every ``nn.Linear``.

Linears whose features are not multiples of 16 stay bf16 too (``torch._scaled_mm``'s rule).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .adamw import AdamW
from .config import PrecisionConfig, PrecisionError
from .fp8 import ALIGN, Float8Linear


def apply_precision(model: nn.Module, config: PrecisionConfig) -> nn.Module:
    """Validate ``config`` for the model's device, then, in place: cast the parameters to
    bf16 when ``model_dtype="bf16"`` (buffers such as rotary frequency tables keep their
    dtype: they are not trained and their precision matters), and swap Linears for
    ``Float8Linear`` when ``matmul_dtype="fp8"`` (see the module docstring). Returns ``model``.
    Run the model under ``autocast_context(config, device_type)``."""
    first = next(model.parameters(), None)
    check_device(config, first.device if first is not None else "cpu")
    if config.model_dtype == "bf16":
        _cast_parameters(model, parameter_dtype(config))
    if config.matmul_dtype == "fp8":
        for block in _fp8_scopes(model):
            _swap_linears(block, config.fp8_grad)
    return model


def check_device(config: PrecisionConfig,
                 device: str | torch.device = "cpu") -> PrecisionConfig:
    """``config.validate()``, then a one-line PrecisionError for what ``device`` (with this
    torch) cannot run; returns ``config`` so that it chains."""
    config.validate()
    device_type = torch.device(device).type
    uses_bf16 = "bf16" in (config.model_dtype, config.optim_dtype) or \
        config.matmul_dtype != "fp32"
    if uses_bf16 and not _runs(device_type, "bf16"):
        raise PrecisionError(f"this {device_type} device cannot run bf16 matmuls: use "
                             "model_dtype, optim_dtype and matmul_dtype 'fp32'")
    if config.matmul_dtype == "fp8" and not _runs(device_type, "fp8"):
        raise PrecisionError(f"matmul_dtype='fp8' needs torch._scaled_mm and float8 dtypes "
                             f"on {device_type}, which torch {torch.__version__} lacks "
                             "there: use matmul_dtype='bf16'")
    return config


def parameter_dtype(config: PrecisionConfig) -> torch.dtype:
    """The dtype ``apply_precision`` stores floating parameters in."""
    return torch.bfloat16 if config.model_dtype == "bf16" else torch.float32


def autocast_context(config: PrecisionConfig, device_type: str) -> AbstractContextManager[Any]:
    """bf16 autocast on ``device_type`` ("cpu", "cuda", ...) when matmuls are bf16 or fp8 (fp8
    Linears cast for themselves; the rest of the model runs in bf16), else a null context."""
    if config.matmul_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def make_optimizer(param_groups: Iterable[Any], config: PrecisionConfig,
                   **adamw_kwargs: Any) -> AdamW:
    """The AdamW for ``config`` (moments in ``optim_dtype``, ``master`` as configured);
    ``adamw_kwargs`` are ``torch.optim.AdamW``'s: lr, betas, eps, weight_decay (and ``seed``
    of the stochastic-rounding generator)."""
    return AdamW(param_groups, moment_dtype=config.optim_dtype, master=config.master,
                 **adamw_kwargs)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every floating parameter with a ``dtype`` copy; a parameter shared by several
    modules (tied embeddings) stays shared, and one in ``dtype`` already (cast as it went to
    the disk tier, whose storage may be empty now) stays as it is."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in cast:
                cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = cast[id(p)]


def _fp8_scopes(model: nn.Module) -> list[nn.Module]:
    """The modules whose Linears become fp8: an HF causal LM's decoder layers, else the model."""
    from ..chain import _is_hf_causal_lm

    if not _is_hf_causal_lm(model):
        return [model]
    from ..chain.hf import decoder_layers

    return [decoder_layers(model.base_model)[1]]


def _swap_linears(root: nn.Module, grad_dtype: str) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and not (child.in_features % ALIGN
                                                 or child.out_features % ALIGN):
                setattr(parent, name, Float8Linear(child, grad_dtype))


@functools.cache
def _runs(device_type: str, kind: str) -> bool:
    """Whether a 16x16 matmul of ``kind`` (bf16, or fp8 through ``torch._scaled_mm``) runs on
    ``device_type``: probed once per process."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        if kind == "bf16":
            a = torch.ones(16, 16, dtype=torch.bfloat16, device=device_type)
            return bool((a @ a)[0, 0].item() == 16)
        f8 = torch.float8_e4m3fn
        a = torch.ones(16, 16, device=device_type).to(f8)
        one = torch.ones((), device=device_type)
        out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return bool(out[0, 0].item() == 16)
    except (AttributeError, RuntimeError, TypeError):
        return False
