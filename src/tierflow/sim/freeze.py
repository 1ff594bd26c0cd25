"""``tierflow plan/sweep --freeze/--train-only``: a ``Selection`` from glob patterns.

The patterns are matched as ``tierflow train`` matches them (``models/freeze.py``: the same
function, the same one-line errors) against the real parameter names of the model, built
on the meta device from its config: no memory, even for 8B models. Each parameter is then
given to the chain stage the trainer's chain would give it (``chain/hf.py``): a decoder
layer's to that layer, the embeddings (2-D parameters outside the layers) to the first
stage, the final norm and the output projection to the last.
"""
from __future__ import annotations

from ..core.errors import TierflowError
from .selection import Selection
from .shapes import model_config


def selection_for(spec: str, freeze: str | None, train_only: str | None) -> Selection | None:
    """What trains in the model ``spec`` names (a preset or a directory with config.json)
    under ``--freeze``/``--train-only``; None when neither is given (everything trains)."""
    if freeze is None and train_only is None:
        return None
    from ..chain.hf import decoder_layers
    from ..models.freeze import freeze_parameters
    from ..models.presets import meta_model

    model = meta_model(model_config(spec))
    try:
        freeze_parameters(model, freeze, train_only)
    except TierflowError as e:  # name the model: a sweep matches the globs in several
        raise TierflowError(f"--model {spec}: {e}") from None
    layers = decoder_layers(model.base_model)[1]
    stage_of = {id(p): 1 + i for i, layer in enumerate(layers) for p in layer.parameters()}
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    last = len(layers) + 1
    trainable, matmul, largest = [0] * (last + 1), [0] * (last + 1), [0] * (last + 1)
    tied_trains = 0
    for p in model.parameters():  # a shared parameter once
        if p is head and tied:
            tied_trains = p.numel() if p.requires_grad else 0
            if p.requires_grad:
                largest[0] = largest[last] = p.numel()
            continue
        i = stage_of.get(id(p), last if p is head or p.dim() < 2 else 0)
        if not p.requires_grad:
            continue
        trainable[i] += p.numel()
        largest[i] = max(largest[i], p.numel())
        if p.dim() >= 2 and i > 0:
            matmul[i] += p.numel()
    given = " ".join(f"{flag} {value!r}" for flag, value in
                     (("--train-only", train_only), ("--freeze", freeze)) if value is not None)
    return Selection(tuple(trainable), tuple(matmul), tuple(largest), tied_trains, given)

