"""The checkpoint files of a run of LoRA adapters (``--lora``): a PEFT adapter directory, and
with ``--merge`` the model with the adapters merged in.

- ``adapter_weights``: ``adapter_config.json`` and ``adapter_model.safetensors``, what
  ``PeftModel.save_pretrained`` writes: the adapters' tensors named by peft's own
  ``get_peft_model_state_dict`` (``base_model.model.<module>.lora_A.weight``, the adapter's
  name left out) and its config with the base model's path, in inference mode. So
  ``peft.PeftModel.from_pretrained(base, step_dir)`` loads the step directory as it is.
  The base's weights are not written: they never change.
- ``merged_weights``: ``merged/config.json`` and ``merged/model.safetensors``, the base
  model's checkpoint as ``save_pretrained`` writes it with each target's weight
  ``W + B @ A * alpha / rank`` (peft's ``merge_and_unload``), computed a tensor at a time as
  it is written, from weights that may wait on the disk tier: the merged model is never
  whole in memory.
- ``load_adapter_weights``: a resumed run's adapters, from such a step directory.

``current`` reads the values a tensor holds now (a weight on the disk tier: from its file).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..core.errors import TierflowError
from .checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    TensorFile,
    WeightFiles,
    config_json,
    model_state_for_saving,
)

if TYPE_CHECKING:
    from peft import PeftModel

Current = Callable[[torch.Tensor], torch.Tensor]
ADAPTER = "default"  # the name peft gives the one adapter of get_peft_model
MERGED = "merged"  # the merged model's directory in a step directory


def adapter_weights(adapters: PeftModel, base: str, current: Current) -> WeightFiles:
    """The adapter directory's files of ``adapters`` (``base``: the ``--model`` they adapt,
    a directory or a preset name)."""
    from peft import get_peft_model_state_dict
    tensors = get_peft_model_state_dict(adapters, state_dict=adapters.state_dict(),
                                        adapter_name=ADAPTER, save_embedding_layers=False)
    config = copy.deepcopy(adapters.peft_config[ADAPTER])
    config.base_model_name_or_path = str(Path(base).resolve()) if Path(base).is_dir() else base
    config.inference_mode = True
    fields = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return WeightFiles({ADAPTER_CONFIG: json.dumps(fields, indent=2, sort_keys=True)},
                       (TensorFile(ADAPTER_WEIGHTS, tensors, {"format": "pt"},
                                   lambda name, t: current(t)),))


def merged_weights(adapters: PeftModel, current: Current) -> WeightFiles:
    """``merged/``: the adapted model's checkpoint with the adapters merged into the weights
    of their base layers, under the base model's names."""
    from peft.tuners.lora import LoraLayer
    model = adapters.base_model.model  # the model the adapters were injected into
    deltas = {f"{name}.base_layer.weight": module for name, module in model.named_modules()
              if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}
    state = model_state_for_saving(model)
    sources: dict[str, str] = {}  # merged name -> the adapted model's name
    for name in state:
        if ".lora_" not in name:
            sources[name.replace(".base_layer.", ".")] = name

    def materialize(name: str, t: torch.Tensor) -> torch.Tensor:
        source = sources[name]
        values = current(state[source])
        layer = deltas.get(source)
        if layer is None:
            return values
        a = current(layer.lora_A[ADAPTER].weight).float()  # (rank, in)
        b = current(layer.lora_B[ADAPTER].weight).float()  # (out, rank)
        delta = (b @ a) * layer.scaling[ADAPTER]
        if layer.fan_in_fan_out:  # GPT-2's Conv1D keeps its weight as (in, out)
            delta = delta.T
        return (values.float() + delta).to(values.dtype)

    merged = {name: state[source] for name, source in sources.items()}
    return WeightFiles({f"{MERGED}/config.json": config_json(model)},
                       (TensorFile(f"{MERGED}/model.safetensors", merged, {"format": "pt"},
                                   materialize),), (MERGED,))


def load_adapter_weights(adapters: PeftModel, directory: Path) -> None:
    """Load the adapters a step directory holds into ``adapters`` (a resumed run's, freshly
    injected in memory); one line if they are not the ones the run's options make."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    fix = "resume with the --model and --lora options it was trained with"
    saved = load_file(str(directory / ADAPTER_WEIGHTS))
    try:
        result = set_peft_model_state_dict(adapters, saved, adapter_name=ADAPTER)
    except RuntimeError as e:  # another rank: the shapes differ
        first = str(e).strip().splitlines()[-1].strip()
        raise TierflowError(f"{directory / ADAPTER_WEIGHTS} holds adapters of other shapes "
                            f"than this run's ({first}): {fix}") from None
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        odd = (missing or result.unexpected_keys)[0]
        raise TierflowError(f"{directory / ADAPTER_WEIGHTS} does not hold the adapters this "
                            f"run makes ({'missing' if missing else 'unexpected'}: {odd}): "
                            f"{fix}")
