"""Build a causal LM from a preset (random init) or a local Hugging Face directory.

A directory is loaded gpt-fast style: the model is built with its parameters on the meta device
(nothing allocated, no random init), every tensor is checked against the safetensors headers
before any is read, the tensors are read once with ``pread`` into memory of their own (handed
over one at a time with ``place``; memory-mapped from ``safe_open`` for generation, which
never writes them) and go in with
``load_state_dict(assign=True)``, and tied weights are tied again. Buffers that are not in a
checkpoint (rotary ``inv_freq``) are built on the CPU by the model's own constructor, so they
are exactly what ``from_pretrained`` computes. Only safetensors is read, never pickle.

``place`` (``init.Place``) is how a caller keeps the model from ever being whole in memory:
it takes each tensor as soon as it is read or initialized (``tierflow.load_model`` puts it on
the disk tier). This package knows nothing about memory tiers; the public entry point,
which picks between a preset and a directory, is ``tierflow.load_model`` (``exec/load.py``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..core.errors import TierflowError
from .files import INDEX_NAME, SINGLE_NAME, read_config_json, require_weight_files
from .init import Place, initialize
from .int8 import align_int8, is_quantized, quantize_int8
from .presets import preset_config
from .safetensors_io import read_header, read_tensor


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers is moved to the meta device as it is
    registered; buffers stay on the CPU (they are small and some, like rotary frequencies,
    are computed in the constructor and not saved in checkpoints)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def random_init(name: str, *, vocab_size: int | None, dtype: torch.dtype, seed: int,
                place: Place | None = None) -> nn.Module:
    """Preset ``name`` (with ``vocab_size`` ids when given) initialized from ``seed`` one
    module at a time (``init.py``), each of its tensors handed to ``place`` when given."""
    return build_random(preset_config(name, vocab_size=vocab_size), dtype=dtype, seed=seed,
                        place=place)


def build_random(config: Any, *, dtype: torch.dtype, seed: int,
                 place: Place | None = None) -> nn.Module:
    """The causal LM of the transformers ``config``, initialized from ``seed`` one module at
    a time (``init.py``), each of its tensors handed to ``place`` when given."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    initialize(model, seed, dtype, place)
    return model


def read_safetensors_index(directory: Path) -> dict[str, Path]:
    """Map each tensor name of the checkpoint in ``directory`` to its safetensors file:
    ``model.safetensors``, or the shards ``model.safetensors.index.json`` names."""
    index = directory / INDEX_NAME
    single = directory / SINGLE_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise TierflowError(f"{index} is not a valid safetensors index ({e}): save the model "
                                "again with save_pretrained") from None
        files = {}
        for tensor, file in weight_map.items():
            shard = directory / str(file)
            if not shard.is_file():
                raise TierflowError(f"{index} names shard {file} for {tensor} but {shard} does "
                                    "not exist: copy all the shards into the directory")
            files[tensor] = shard
        return files
    require_weight_files(directory)
    with _open_safetensors(single) as f:
        return {k: single for k in f.keys()}


@contextlib.contextmanager
def _open_safetensors(path: Path):
    from safetensors import safe_open
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: a corrupt header or a truncated file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TierflowError(f"{path} is not a readable safetensors file ({detail}): the file is "
                            "corrupt or truncated; copy or save it again") from None
    with handle as f:
        yield f


def read_config(directory: Path):
    """The transformers config of the model directory ``directory`` (its config.json checked
    first); a one-line error when transformers does not know it."""
    from transformers import AutoConfig

    config_file = directory / "config.json"
    read_config_json(directory)
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TierflowError(f"{config_file} is not a config transformers knows ({detail}): "
                            "use a causal LM directory written by save_pretrained") from None


def _tied_pairs(model: nn.Module) -> dict[str, str]:
    """{target: source} of the weights the config ties (lm_head.weight -> embed_tokens)."""
    getter = getattr(model, "get_expanded_tied_weights_keys", None)
    return dict(getter(all_submodels=True)) if getter is not None else {}


def _renamings(model: nn.Module) -> list[Any]:
    """The key renamings transformers (5.x) applies when it loads ``model``'s checkpoints
    (GPT-NeoX's ``embed_out.`` is the module ``lm_head.``); none with a transformers that
    has no such table (4.x names the modules as the checkpoints do). Conversions that merge
    or split tensors are not renamings and are left out."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
        return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):
        return []


def _match_names(model: nn.Module, names: set[str]) -> dict[str, str]:
    """{checkpoint name: model name}: names saved from the base model (GPT-2's ``h.0...``
    without ``transformer.``) get the base model's prefix; legacy names get transformers'
    renaming (``_renamings``)."""
    expected = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", "")
    renamings = None
    mapping = {}
    for name in names:
        if name in expected:
            mapping[name] = name
        elif prefix and f"{prefix}.{name}" in expected:
            mapping[name] = f"{prefix}.{name}"
        else:
            renamings = _renamings(model) if renamings is None else renamings
            renamed = (r.rename_source_key(name)[0] for r in renamings)
            mapping[name] = next((n for n in renamed if n in expected), name)
    return mapping


def _short(names: list[str], n: int = 3) -> str:
    shown = ", ".join(sorted(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def build_on_meta(directory: Path, dtype: torch.dtype | None, *, config: Any = None,
                  for_generation: bool = False) -> nn.Module:
    """The causal LM that ``directory``'s config.json (or ``config``, read from it already)
    describes, its parameters on the meta device; with the int8 layers of ``tierflow
    quantize`` when the config says so, which only generation accepts."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else read_config(directory)
    with params_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(
                config, "dtype", None) or torch.float32)
        except ValueError as e:
            raise TierflowError(f"{directory / 'config.json'} does not describe a causal LM "
                                f"transformers can build ({str(e).splitlines()[0]}): use a "
                                "causal LM checkpoint") from None
    if is_quantized(config):
        if not for_generation:
            raise TierflowError(f"{directory} holds int8 weights written by tierflow quantize, "
                                "which only tierflow generate reads: train or evaluate from the "
                                "checkpoint it was quantized from")
        quantize_int8(model)
    return model


def load_pretrained(directory: Path, *, dtype: torch.dtype | None = torch.float32,
                    place: Place | None = None, for_generation: bool = False) -> nn.Module:
    """Load the causal LM saved in ``directory``, in eval mode (as ``from_pretrained``).
    ``dtype=None`` keeps the checkpoint's. With ``place`` each tensor is handed to it as soon
    as it is read: the model never exists whole in memory. ``for_generation`` accepts a
    ``tierflow quantize`` checkpoint."""
    config = read_config(directory)
    files = read_safetensors_index(directory)  # checks shard files before building anything
    model = build_on_meta(directory, dtype, config=config, for_generation=for_generation)
    targets = model.state_dict(keep_vars=True)
    tied = _tied_pairs(model)
    rename = _match_names(model, set(files))

    # Check every name and shape against the headers before reading any tensor.
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                      or [])] + [re.compile(r"rotary_emb\.inv_freq$")]
    by_file: dict[Path, list[tuple[str, str]]] = {}
    unexpected = []
    for name, file in files.items():
        target = rename[name]
        if target in targets:
            by_file.setdefault(file, []).append((name, target))
        elif not any(p.search(name) for p in ignore):
            unexpected.append(name)
    present = {t for pairs in by_file.values() for _, t in pairs}
    # One of a tied pair is enough; when only the target was saved it becomes the source.
    pairs = {}
    for target, source in tied.items():
        if source not in present and target in present:
            target, source = source, target
        pairs[target] = source
    tied = pairs
    missing = [k for k in targets if k not in present and not (k in tied and tied[k] in present)]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors missing ({_short(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_short(unexpected)})")
        raise TierflowError(f"the weights in {directory} do not match its config.json "
                            f"({model.config.model_type}): {'; '.join(parts)}: use the "
                            "config.json saved with these weights")

    if place is not None:  # tied copies are compared first: they are not kept in memory
        _check_tied_copies(directory, tied, by_file)
        for target in tied:
            for pairs in by_file.values():
                pairs[:] = [(n, t) for n, t in pairs if t != target or tied[t] not in present]
    state: dict[str, torch.Tensor] = {}
    # a model to train is read into memory of its own: its weights, once written by the
    # optimizer, would otherwise leave the file's pages (counted in the RSS when the kernel
    # began holding the budget, --enforce) for fresh copies charged again
    read = _read_mapped if place is None and for_generation else _read_once
    for file, pairs in by_file.items():
        for target, tensor in read(file, pairs, targets):
            if place is not None:
                place(target, tensor)
            state[target] = tensor

    # A tied target the checkpoint also holds must equal its source; it is then re-tied.
    for target, source in list(tied.items()) if place is None else ():
        if target in state and source in state:
            if not torch.equal(state[target], state[source]):
                raise TierflowError(f"config.json of {directory} ties {target} to {source} but "
                                    "the checkpoint holds different values: set "
                                    "tie_word_embeddings to false in config.json")
            del state[target]
    for target, source in tied.items():  # the tied target is not loaded: point it at the source
        if source in state:
            state.setdefault(target, state[source])
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.tie_weights()
    align_int8(model)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t.device.type == "meta"]
    if leftover:
        raise TierflowError(f"the weights in {directory} leave {_short(leftover)} unset: use "
                            "the config.json saved with these weights")
    model.eval()
    return model


def _check_shape(file: Path, name: str, shape: tuple, want: tuple) -> None:
    if shape != want:
        raise TierflowError(f"tensor {name} in {file} has shape {list(shape)} but config.json "
                            f"needs {list(want)}: use the config.json saved with these weights")


def _read_mapped(file: Path, pairs: list[tuple[str, str]], targets: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(target, tensor) for each (name in the file, target) pair, memory-mapped: the model
    keeps the mapping, read when first touched."""
    with _open_safetensors(file) as f:
        for name, target in pairs:
            _check_shape(file, name, tuple(f.get_slice(name).get_shape()),
                         tuple(targets[target].shape))
            tensor = f.get_tensor(name)
            want = targets[target].dtype
            yield target, tensor.to(want) if tensor.dtype != want and \
                tensor.is_floating_point() else tensor


def _read_once(file: Path, pairs: list[tuple[str, str]], targets: dict[str, torch.Tensor]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The same, each tensor read with ``pread`` into a fresh buffer and dropped from the page
    cache: for a model whose tensors are handed over as they are read (to the disk tier),
    whose file must not stay mapped (a mapping's touched pages count in the RSS until it is
    closed)."""
    stored = read_header(file)
    for name, target in pairs:
        _check_shape(file, name, stored[name].shape, tuple(targets[target].shape))
    fd = os.open(file, os.O_RDONLY)
    try:
        for name, target in pairs:
            want = targets[target].dtype
            dtype = want if stored[name].dtype.is_floating_point else stored[name].dtype
            yield target, read_tensor(fd, stored[name], dtype)
    finally:
        os.close(fd)


def _check_tied_copies(directory: Path, tied: dict[str, str],
                       by_file: dict[Path, list[tuple[str, str]]]) -> None:
    """A tied target the checkpoint also holds must equal its source (read pair by pair)."""
    where = {target: (file, name) for file, pairs in by_file.items() for name, target in pairs}
    for target, source in tied.items():
        if target not in where or source not in where:
            continue
        values = []
        for file, name in (where[target], where[source]):
            with _open_safetensors(file) as f:
                values.append(f.get_tensor(name))
        if not torch.equal(*values):
            raise TierflowError(f"config.json of {directory} ties {target} to {source} but the "
                                "checkpoint holds different values: set tie_word_embeddings "
                                "to false in config.json")
