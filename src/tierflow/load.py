"""``tierflow.load_model``: a Hugging Face causal LM for ``tierflow.fit``, built or loaded
straight onto a disk tier when it should never be whole in RAM.

``fit`` can move a model that is in RAM to its disk tier, but by then the model has passed
through RAM whole: a 1.1B model in fp32 is 4.4 GB there before any budget applies. Built
here with ``disk=DIR``, a preset is initialised one module at a time and a checkpoint read
one tensor at a time, each written to ``DIR`` and emptied in memory (``models/load.py``,
``models/init.py``); ``fit`` then finds the model's disk tier on its parameters and streams
from it, as ``tierflow train --disk`` does.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_model(spec: str | Path, *, disk: str | Path | None = None,
               dtype: torch.dtype = torch.float32, seed: int = 0,
               vocab_size: int | None = None) -> nn.Module:
    """The causal LM of ``spec``: a preset name (``llama-20m``, ``tinyllama-1.1b``, ...; a
    random init from ``seed``, with ``vocab_size`` ids when given) or a local directory of
    ``config.json`` and safetensors weights (``save_pretrained``'s), in training mode.

    ``disk``: an existing directory for the disk tier. The weights are written there, one
    file per module, and the parameters stay empty in memory until ``fit`` places them;
    pass the same model to ``fit`` with ``optimizer=`` (and ``ram=``). Remove the directory
    after the last step (``module.settle()`` first). Without ``disk`` the model is built in
    RAM, as ``from_pretrained`` would."""
    from .exec.disk import DiskStore
    from .exec.offload import OffloadedParameters
    from .models.load import load_model as load

    offload = OffloadedParameters(DiskStore(disk)) if disk is not None else None
    return load(spec, vocab_size=vocab_size, dtype=dtype, seed=seed, offload=offload).train()
