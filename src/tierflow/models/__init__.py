"""Models: architecture presets and loading local Hugging Face checkpoints (gpt-fast style:
built on the meta device, weights memory-mapped from safetensors, loaded with assign=True).
The models know nothing about memory tiers: ``tierflow.load_model`` builds or loads one
(onto the disk tier when asked) with this package's ``load.py`` functions.

``read_safetensors_index`` (and torch with it) is imported only when it is used."""
from __future__ import annotations

from typing import Any

from .presets import PRESETS, Preset, count_parameters, preset_config


def __getattr__(name: str) -> Any:
    if name == "read_safetensors_index":
        from . import load
        return getattr(load, name)
    raise AttributeError(f"module 'tierflow.models' has no attribute {name!r}")


__all__ = ["PRESETS", "Preset", "preset_config", "count_parameters", "read_safetensors_index"]
