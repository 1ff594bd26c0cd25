"""Crash-safe training checkpoints that ``transformers`` loads as they are.

``save_checkpoint(out, step, model, ...)`` writes ``out/step_N/``:

- ``config.json`` and ``model.safetensors``: what ``save_pretrained`` writes (tied weights
  saved once, under the name the model expects), so ``AutoModelForCausalLM.from_pretrained``
  and ``tierflow.load_model`` read the directory as it is; a run of LoRA adapters writes
  ``adapter_config.json`` and ``adapter_model.safetensors`` instead (``adapter_files.py``:
  what ``PeftModel.save_pretrained`` writes), and with ``--merge`` a ``merged/`` directory of
  the first kind. ``WeightFiles`` says which files a checkpoint's weights go in;
- ``tokenizer.json``: a copy of the run's tokenizer, when given, and the files given beside it
  (``tokenizer_config.json`` with the chat template, ``generation_config.json``, ...: the
  model directory's, so that transformers loads the checkpoint as it loaded the model);
- ``optimizer.safetensors``: every tensor of the optimizer states, named by
  ``codec.flatten_optimizer_states`` (``opt.<stage>.state.<param_index>.<state_name>``, e.g.
  ``opt.0.state.3.exp_avg``); the rest of the state dicts (param_groups, non-tensor values)
  is JSON in the file's metadata under ``tierflow.optimizer``;
- ``trainer_state.json``: ``{"format": "tierflow-trainer-state", "version": 1, "step": N,
  "state": ...}`` with the trainer's dict; tensors in it (``torch.get_rng_state()``) are stored
  inline as base64, tuples and non-string keys are tagged so they come back as they went in.

Everything is written into ``out/step_N.tmp-<pid>``; each file and the directory are fsynced,
then the directory is renamed to ``step_N`` and ``out`` is fsynced. A failure at any point
removes the temporary directory and leaves earlier checkpoints as they were. Only JSON and
safetensors are ever read back, never pickle.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..core.errors import TierflowError
from ..core.page_cache import drop_from_page_cache
from .checkpoint_dirs import (
    STATE_FILE,
    checkpoint_directory,
    intact_note,
    remove_stale_temps,
)
from .codec import (
    flatten_optimizer_states,
    from_json,
    raw_bytes,
    to_json,
    unflatten_optimizer_states,
)

STATE_FORMAT = "tierflow-trainer-state"
ADAPTER_CONFIG = "adapter_config.json"  # peft's names for an adapter directory's files
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FORMAT = "tierflow-optimizer"
VERSION = 1
Materialize = Callable[[str, torch.Tensor], torch.Tensor]

# ---------------------------------------------------------------------------------------------
# safetensors, written by streaming one tensor at a time (no second copy of the model)

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _write(f, data) -> None:
    """Every byte of a checkpoint goes through here (tests make it fail like a full disk)."""
    f.write(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        _write(f, data)
        f.flush()
        os.fsync(f.fileno())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None,
                      materialize: Materialize | None = None) -> None:
    """Write ``tensors`` in the safetensors format, one tensor at a time in the dict's order,
    fsync the file and drop it from the page cache. ``materialize(name, tensor)``, when given,
    returns the values to write for each entry: the entries may then be meta tensors (a shape
    and a dtype) whose values are read only when their turn comes, so a checkpoint of state
    larger than the RAM budget holds one tensor (or one stage) at a time."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise TierflowError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot "
                                "store: convert it to a float or integer dtype")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    # The data starts on a 64-byte boundary (the format allows padding the header with
    # spaces), so that a memory-mapped tensor whose offset is a multiple of 64 is aligned
    # for vector loads: int8 weights (``models/int8.py``) need that to skip a copy.
    raw += b" " * (-(8 + len(raw)) % 64)
    with open(path, "wb") as f:
        _write(f, struct.pack("<Q", len(raw)))
        _write(f, raw)
        for name, t in tensors.items():
            values = materialize(name, t) if materialize is not None else t
            if values.shape != t.shape or values.dtype != t.dtype:
                raise ValueError(f"{name}: materialized as {values.dtype} {list(values.shape)}, "
                                 f"announced as {t.dtype} {list(t.shape)}")
            _write(f, raw_bytes(values))
        f.flush()
        os.fsync(f.fileno())
        drop_from_page_cache(f.fileno())  # written and synced: no need to keep it cached


def _open_safetensors(path: Path):
    from safetensors import safe_open
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # a corrupt header or a truncated file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TierflowError(f"{path} is not a readable safetensors file ({detail}): the "
                            "checkpoint is damaged; resume from an earlier step_N") from None


# ---------------------------------------------------------------------------------------------
# the model as save_pretrained writes it

def _tied_targets(model) -> set[str]:
    getter = getattr(model, "get_expanded_tied_weights_keys", None)
    return set(getter(all_submodels=True)) if getter is not None else set()


def model_state_for_saving(model) -> dict[str, torch.Tensor]:
    """The model's state dict with each tied weight once, under the name ``from_pretrained``
    expects (the source, e.g. ``model.embed_tokens.weight``); other aliases are cloned."""
    state = model.state_dict()
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
    for key in list(state):
        if any(re.search(p, key) for p in ignore):
            del state[key]
    tied = _tied_targets(model)
    by_storage: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if t.device.type == "meta":
            raise TierflowError(f"parameter {name} is on the meta device (never loaded): load "
                                "the weights before saving a checkpoint")
        if t.numel():  # the storage object: one on the disk tier is empty (pointer 0)
            by_storage.setdefault(t.untyped_storage()._cdata, []).append(name)
    for names in by_storage.values():
        if len(names) < 2:
            continue
        keep = [n for n in names if n not in tied] or names[:1]
        first = state[keep[0]]
        for n in names:
            if n == keep[0]:
                continue
            same = (state[n].data_ptr() == first.data_ptr() and state[n].shape == first.shape
                    and state[n].stride() == first.stride())
            if n in tied and same:
                del state[n]
            else:
                state[n] = state[n].clone()
    return state


def config_json(model) -> str:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise TierflowError(f"cannot checkpoint a {type(model).__name__}: pass the transformers "
                            "model (a PreTrainedModel with a .config)")
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if floats:
        config.dtype = str(floats[0]).removeprefix("torch.")
    return config.to_json_string(use_diff=True)


@dataclass(frozen=True)
class TensorFile:
    """One safetensors file of a checkpoint: its path in the step directory, its tensors by
    name (meta or emptied ones allowed with ``materialize``, see ``write_safetensors``) and
    its header's metadata."""
    path: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    materialize: Materialize | None = None


@dataclass(frozen=True)
class WeightFiles:
    """What a checkpoint's weights are written as: ``texts`` (JSON files by their path in the
    step directory), ``tensors`` (safetensors files) and ``homes``, the directories (relative
    to the step directory, "" itself) that each get a copy of the tokenizer's files."""
    texts: dict[str, str]
    tensors: tuple[TensorFile, ...]
    homes: tuple[str, ...] = ("",)

    @classmethod
    def of_model(cls, model, materialize: Materialize | None = None,
                 home: str = "") -> WeightFiles:
        """``model`` as ``save_pretrained`` writes it, in ``home``: config.json and
        model.safetensors (``materialize`` reads the weights not in memory)."""
        prefix = f"{home}/" if home else ""
        return cls({prefix + "config.json": config_json(model)},
                   (TensorFile(prefix + "model.safetensors", model_state_for_saving(model),
                               {"format": "pt"}, materialize),), (home,))

    def __add__(self, other: WeightFiles) -> WeightFiles:
        return WeightFiles({**self.texts, **other.texts}, self.tensors + other.tensors,
                           self.homes + other.homes)


# ---------------------------------------------------------------------------------------------
# checkpoints

def save_checkpoint(out_dir: str | Path, step: int, model, *,
                    tokenizer_file: str | Path | None = None,
                    tokenizer_extras: Sequence[Path] = (),
                    optimizer_state: Sequence[dict | None] | None = None,
                    trainer_state: dict | None = None,
                    materialize_weights: Materialize | None = None,
                    materialize_optimizer: Materialize | None = None) -> Path:
    """Write ``out_dir/step_<step>/`` (see the module docstring) and return its path.

    ``model``: the model, or the ``WeightFiles`` to write (``materialize_weights`` is then
    theirs). ``optimizer_state`` is a list of torch optimizer ``state_dict()``s (one per stage, None
    where a stage has none), or one state dict. ``trainer_state`` is any JSON-like dict
    (tensors allowed): the data position, ``capture_rng()``, the run's ``config_hash``.
    ``materialize_weights`` and ``materialize_optimizer`` read the values of weights and
    optimizer states that are not in memory (see ``write_safetensors``), named as in the
    model's state dict and as ``flatten_optimizer_states`` names them.
    Saving a step that exists replaces it only once the new one is complete."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TierflowError(f"checkpoint step {step!r} is not a non-negative integer")
    out_dir = Path(out_dir)
    final = out_dir / f"step_{step}"
    if tokenizer_file is not None and not Path(tokenizer_file).is_file():
        raise TierflowError(f"tokenizer file {tokenizer_file} does not exist: pass the "
                            "tokenizer.json the run was tokenized with")
    if isinstance(optimizer_state, dict):
        optimizer_state = [optimizer_state]
    # Everything that can fail without touching the disk is done first.
    weights = model if isinstance(model, WeightFiles) else \
        WeightFiles.of_model(model, materialize_weights)
    opt_tensors, opt_structure = (flatten_optimizer_states(optimizer_state)
                                  if optimizer_state is not None else ({}, None))
    state_json = json.dumps({"format": STATE_FORMAT, "version": VERSION, "step": step,
                             "state": to_json(dict(trainer_state or {}))}, indent=1)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TierflowError(f"cannot create checkpoint directory {out_dir} ({e.strerror}): use "
                            "--out with a writable directory") from None
    temp = out_dir / f"step_{step}.tmp-{os.getpid()}"
    replaced = out_dir / f"step_{step}.replaced-{os.getpid()}"
    try:
        remove_stale_temps(out_dir)
        if temp.exists():
            shutil.rmtree(temp)
        temp.mkdir()
        for home in weights.homes:
            (temp / home).mkdir(exist_ok=True)
        for name, text in weights.texts.items():
            _write_bytes(temp / name, text.encode())
        for file in weights.tensors:
            write_safetensors(temp / file.path, file.tensors, file.metadata, file.materialize)
        for source, name in ([(tokenizer_file, "tokenizer.json")] if tokenizer_file else []) \
                + [(p, Path(p).name) for p in tokenizer_extras]:
            for home in weights.homes:
                _copy_file(Path(source), temp / home / name)
        for home in weights.homes:
            if home:
                _fsync_dir(temp / home)
        if opt_structure is not None:
            write_safetensors(temp / "optimizer.safetensors", opt_tensors,
                              {"format": OPTIMIZER_FORMAT, "version": str(VERSION),
                               "tierflow.optimizer": json.dumps(opt_structure)},
                              materialize_optimizer)
        _write_bytes(temp / STATE_FILE, state_json.encode())  # last: marks complete
        _fsync_dir(temp)
        if final.exists():
            final.rename(replaced)
        temp.rename(final)
        _fsync_dir(out_dir)
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        if replaced.exists() and not final.exists():
            replaced.rename(final)
        intact = intact_note(out_dir)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise TierflowError(f"no space left on device writing checkpoint to {final}: free "
                                f"space or use --out elsewhere; {intact}") from None
        raise TierflowError(f"cannot write checkpoint to {final} ({e.strerror or e}): check the "
                            f"permissions or use --out elsewhere; {intact}") from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        if replaced.exists() and not final.exists():
            replaced.rename(final)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def _copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through ``_write``, synced."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(1 << 20):
            _write(dst, chunk)
        dst.flush()
        os.fsync(dst.fileno())


class OptimizerFile:
    """A checkpoint's ``optimizer.safetensors``, read a tensor at a time (``pread``, never
    memory-mapped) or whole."""

    def __init__(self, path: Path, structure: Any):
        from ..models.safetensors_io import read_header
        self.path = path
        self.structure = structure
        self.tensors = read_header(path)
        missing = [name for name in _references(structure) if name not in self.tensors]
        if missing:
            raise TierflowError(f"{path} names tensor {missing[0]} in its metadata but does not "
                                "hold it: the checkpoint is damaged; resume from an earlier "
                                "step_N")

    def references(self) -> list[dict | None]:
        """The state dicts with each tensor's name in its place (read them with ``read``)."""
        return unflatten_optimizer_states({name: name for name in self.tensors}, self.structure)

    def read(self, name: str) -> torch.Tensor:
        from ..models.safetensors_io import read_tensor
        stored = self.tensors[name]
        fd = os.open(stored.file, os.O_RDONLY)
        try:
            return read_tensor(fd, stored, stored.dtype)
        finally:
            os.close(fd)

    def read_all(self) -> list[dict | None]:
        """Every state dict, with its tensors in memory."""
        return unflatten_optimizer_states({name: self.read(name) for name in self.tensors},
                                          self.structure)


def _references(structure: Any) -> list[str]:
    if isinstance(structure, dict):
        if "__tensor__" in structure:
            return [structure["__tensor__"]]
        return [name for value in structure.values() for name in _references(value)]
    if isinstance(structure, list):
        return [name for value in structure for name in _references(value)]
    return []


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` read. The weights stay on disk: load them with
    ``tierflow.load_model(checkpoint.path)``; so do the optimizer's states
    (``optimizer``, read a tensor at a time or whole with ``optimizer_state``)."""
    path: Path
    step: int
    trainer_state: dict
    optimizer: OptimizerFile | None
    config: dict  # config.json (a checkpoint of adapters: adapter_config.json)
    has_tokenizer: bool
    adapter: bool = False  # LoRA adapters only (adapter_files.py): the base is the run's model

    @property
    def optimizer_state(self) -> list[dict | None] | None:
        """The optimizer states, one state dict per stage as saved, read whole."""
        return self.optimizer.read_all() if self.optimizer is not None else None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the checkpoint ``path`` (a ``step_N`` directory, or a run's ``--out``
    directory, meaning its latest checkpoint). Any damage is one ``TierflowError`` line."""
    path = checkpoint_directory(path)
    try:
        data = json.loads((path / STATE_FILE).read_text())
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, not {STATE_FORMAT!r}")
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}; this tierflow reads {VERSION}")
        step = int(data["step"])
        trainer_state = from_json(data["state"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TierflowError(f"{path / STATE_FILE} is not a valid trainer state ({e}): "
                            "resume from an earlier step_N") from None
    adapter = (path / ADAPTER_CONFIG).is_file()
    config_file = path / (ADAPTER_CONFIG if adapter else "config.json")
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise TierflowError(f"no config.json in {path}: the checkpoint is incomplete; resume "
                            "from an earlier step_N") from None
    except ValueError as e:
        raise TierflowError(f"{config_file} is not valid JSON ({e}): resume from an "
                            "earlier step_N") from None
    if adapter:  # the adapters' file is there and its header parses
        with _open_safetensors(path / ADAPTER_WEIGHTS):
            pass
    else:
        from ..models.load import read_safetensors_index
        read_safetensors_index(path)  # the weights are there and their headers parse
    optimizer = None
    opt_file = path / "optimizer.safetensors"
    if opt_file.is_file():
        with _open_safetensors(opt_file) as f:
            meta = f.metadata() or {}
            try:
                if meta.get("format") != OPTIMIZER_FORMAT:
                    raise ValueError(f"format is {meta.get('format')!r}")
                structure = json.loads(meta["tierflow.optimizer"])
            except (ValueError, KeyError) as e:
                raise TierflowError(f"{opt_file} is not a tierflow optimizer state ({e}): resume "
                                    "from an earlier step_N") from None
        optimizer = OptimizerFile(opt_file, structure)
    return Checkpoint(path, step, trainer_state, optimizer, config,
                      (path / "tokenizer.json").is_file(), adapter)
