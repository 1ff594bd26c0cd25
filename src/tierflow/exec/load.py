"""``tierflow.load_model``: a Hugging Face causal LM for ``tierflow.fit`` and ``tierflow train``,
built or loaded straight onto a disk tier when it should never be whole in RAM.

``fit`` can move a model that is in RAM to its disk tier, but by then the model has passed
through RAM whole: a 1.1B model in fp32 is 4.4 GB there before any budget applies. Built
here with ``disk=DIR``, a preset is initialised one module at a time and a checkpoint read
one tensor at a time (``models/init.py``, ``models/load.py``), each tensor handed as it is
complete to the disk tier (``exec/offload.py``), which writes it to ``DIR`` and empties it
in memory; ``fit`` then finds the model's disk tier on its parameters and streams from it.
This is the one place that joins the two: the models know nothing about memory tiers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..core.errors import TierflowError


def load_model(spec: str | Path, *, disk: str | Path | None = None,
               dtype: torch.dtype | None = torch.float32, seed: int = 0,
               vocab_size: int | None = None, disk_dtype: torch.dtype | None = None,
               for_generation: bool = False) -> nn.Module:
    """The causal LM of ``spec``, in training mode: a preset name (``llama-20m``,
    ``tinyllama-1.1b``, ...; a random init from ``seed``, with ``vocab_size`` ids when given)
    or a local directory of ``config.json`` and safetensors weights (``save_pretrained``'s;
    ``vocab_size`` is then the tokenizer's, checked against the model's). ``dtype``: of the
    floating weights; None keeps a checkpoint's own (a preset's: fp32).

    ``disk``: an existing directory for the disk tier. The weights are written there, one
    file per tensor, and the parameters stay empty in memory until ``fit`` places them;
    pass the same model to ``fit`` with ``optimizer=`` (and ``ram=``). ``disk_dtype``: the
    dtype floating weights are kept in there (a training precision's bf16 weights, cast one
    tensor at a time; default ``dtype``). Remove the directory after the last step
    (``module.settle()`` first). Without ``disk`` the model is built in RAM, as
    ``from_pretrained`` would. ``for_generation`` accepts a directory of int8 weights
    (``tierflow quantize``), which only generation reads."""
    from ..models.load import load_pretrained, random_init
    from ..models.presets import model_directory
    from .disk import DiskStore
    from .offload import OffloadedParameters, attach

    offloaded = OffloadedParameters(DiskStore(disk), dtype=disk_dtype) \
        if disk is not None else None
    place = offloaded.offload if offloaded is not None else None
    directory = model_directory(spec)
    if directory is None:
        model = random_init(str(spec), vocab_size=vocab_size, dtype=dtype or torch.float32,
                            seed=seed, place=place)
    else:
        model = load_pretrained(directory, dtype=dtype, place=place,
                                for_generation=for_generation)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise TierflowError(f"the tokenizer's vocabulary ({vocab_size}) is larger than the "
                                f"model's ({model.config.vocab_size} in "
                                f"{directory / 'config.json'}): tokenize with the model's own "
                                "tokenizer")
    if offloaded is not None:
        attach(model, offloaded)
    return model.train()
