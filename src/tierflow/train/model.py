"""The model a run trains and the identity a checkpoint must match to be resumed.

``build_model`` loads the preset, directory or checkpoint (always through fp32, which holds a
bf16 checkpoint's values exactly), applies the precision (``tierflow.precision``: bf16 weights,
fp8 Linears) before any optimizer state exists, freezes what ``--freeze`` and ``--train-only``
name (``freeze.py``) or, under ``--lora``, injects peft's adapters and freezes the rest
(``models/lora.py``), and checks what would make every step fail: non-finite weights, token
ids beyond the vocab, a sequence longer than the model's positions. A run of adapters resumes
from a checkpoint that holds only them: the base is the run's ``--model`` again.

``run_identity`` hashes what decides the sequence of losses: the architecture, the data, the
batch shape, the seed, the precision, the frozen parameters' patterns and the adapters. A
checkpoint of
another identity is refused with a line that names the differences.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import TierflowError
from ..exec.offload import offloaded_parameters
from ..models.files import max_positions
from ..models.freeze import freeze_parameters
from ..models.lora import LoraSpec, add_adapters, split_targets
from ..precision import PrecisionConfig, apply_precision, parameter_dtype
from .codec import config_hash, differences, model_arch, spec_arch
from .device import ParameterCount
from .model_limits import check_model_limits

if TYPE_CHECKING:
    from peft import PeftModel
    from torch import nn

    from .options import TrainOptions
    from .run import Run


def lora_spec(opts: TrainOptions) -> LoraSpec | None:
    """The adapters ``--lora`` and its options ask for (None without ``--lora``)."""
    if opts.lora is None:
        return None
    alpha = opts.lora_alpha if opts.lora_alpha is not None else float(opts.lora)
    return LoraSpec(opts.lora, float(alpha), float(opts.lora_dropout),
                    split_targets(opts.lora_targets))


def build_model(run: Run, precision: PrecisionConfig,
                disk: Path | None = None) -> tuple[nn.Module, PeftModel | None]:
    """The model ``run`` trains, in training mode, with ``precision`` applied and the
    parameters ``--freeze`` and ``--train-only`` name frozen; under ``--lora`` with peft's
    adapters injected (the ``PeftModel`` around the model is returned beside it, else None)
    and every base weight frozen. With ``disk`` (the disk tier's directory) it is built or
    loaded straight onto the disk tier there (``tierflow.load_model``), a module or a tensor
    at a time, its weights kept in the precision's dtype: it never exists whole in memory."""
    from ..exec.load import load_model
    from ..models.presets import PRESETS

    opts, ckpt, data = run.opts, run.ckpt, run.data
    spec = opts.model
    on_disk = dict(disk=disk, disk_dtype=parameter_dtype(precision)) if disk is not None else {}
    # a checkpoint of adapters holds only them: the base is the run's --model again
    ckpt_base = ckpt if ckpt is not None and not ckpt.adapter else None
    if ckpt_base is not None:
        model = load_model(ckpt_base.path, dtype=torch.float32, **on_disk)
    elif spec in PRESETS:
        model = load_model(spec, vocab_size=data.vocab_size, dtype=torch.float32, seed=opts.seed,
                           **on_disk)
    else:
        model = load_model(spec, dtype=torch.float32, **on_disk)
    if ckpt_base is not None or spec not in PRESETS:  # a random init is finite
        _check_finite(model, ckpt_base.path if ckpt_base is not None else spec)
    check_model_limits(str(spec), opts.seq_len, data, int(model.config.vocab_size),
                       max_positions(model.config))
    adapters = None
    lora = lora_spec(opts)
    if lora is not None:
        adapters = add_adapters(model, lora, opts.seed)
        if ckpt is not None and ckpt.adapter:  # else run_identity refuses the checkpoint
            from .adapter_files import load_adapter_weights
            load_adapter_weights(adapters, ckpt.path)
    apply_precision(model, precision)
    freeze_parameters(model, opts.freeze, opts.train_only)
    model.train()
    return model, adapters


def count_model_parameters(run: Run) -> ParameterCount:
    """The parameters of the model ``build_model`` would build, counted on the meta device
    from its config with the run's frozen selection applied: nothing allocated, whatever the
    model's size, and a pattern that matches no parameter is refused before anything is
    built."""
    from ..models.load import read_config
    from ..models.presets import PRESETS, count_parameters, meta_model, preset_config

    opts, ckpt = run.opts, run.ckpt
    if ckpt is not None and not ckpt.adapter:
        config = read_config(ckpt.path)
    elif opts.model in PRESETS:
        config = preset_config(opts.model, vocab_size=run.data.vocab_size)
    else:
        config = read_config(Path(opts.model))
    model = meta_model(config)
    freeze_parameters(model, opts.freeze, opts.train_only)
    lora = lora_spec(opts)
    if lora is not None:  # the adapters count among the parameters, and only they train
        add_adapters(model, lora, opts.seed)
    trainable = sum({id(p): p.numel() for p in model.parameters() if p.requires_grad}.values())
    return ParameterCount(count_parameters(config, model), trainable)


def _check_finite(model, source) -> None:
    offload = offloaded_parameters(model)
    bad = []
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        # a sum is inf or nan when an element is (no mask of the model's size); an
        # overflowing sum of finite values is counted out by the second look
        with torch.no_grad(), offload.resident([p]) if offload else contextlib.nullcontext():
            if not math.isfinite(float(p.sum())):
                count = int((~torch.isfinite(p)).sum())
                if count:
                    bad.append((name, count))
    if bad:
        where = ", ".join(f"{n} ({k} values)" for n, k in bad[:3])
        raise TierflowError(f"the weights of {source} hold inf or nan in {where}"
                            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}: every loss "
                            "would be nan; use a checkpoint saved before the loss diverged or "
                            "the original model")


def run_identity(run: Run, model, precision: PrecisionConfig) -> tuple[dict[str, Any], str]:
    """(identity, its hash) of ``run`` training ``model``; with a checkpoint, refuse it
    unless the hashes match."""
    opts, ckpt, data = run.opts, run.ckpt, run.data
    arch = model_arch(model)
    if ckpt is not None and "model" in opts.given:  # the checkpoint's weights, the given model
        arch = spec_arch(opts.model, data.vocab_size)
    identity = {"model": arch, "data": data.identity(), "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "grad_accum": opts.grad_accum, "seed": opts.seed,
                "precision": precision.to_dict()}
    for name in ("freeze", "train_only"):  # absent unless given: earlier runs' hashes hold
        if getattr(opts, name) is not None:
            identity[name] = getattr(opts, name)
    lora = lora_spec(opts)
    if lora is not None:
        identity["lora"] = lora.identity()
    run_hash = config_hash(identity)
    if ckpt is not None and ckpt.trainer_state.get("config_hash") != run_hash:
        saved = ckpt.trainer_state.get("identity")
        diffs = differences(saved, identity) if isinstance(saved, dict) else ["unknown run"]
        raise TierflowError(f"checkpoint {ckpt.path} is of a different run ("
                            f"{'; '.join(diffs[:4])}): resume with the model, data, "
                            "--seq-len/--batch-size/--grad-accum/--seed and precision flags "
                            "(--model-dtype/--master/--optim-dtype/--matmul-dtype/--fp8-grad) "
                            "and --freeze/--train-only/--lora it was trained with, or start a new "
                            "run from it without --resume (--model with its step directory)")
    return identity, run_hash
