"""``tierflow quantize``: write a copy of a checkpoint with int8 linear weights, for generation.

The model is built on the meta device and ``models.int8.quantizable`` names the linear layers
to quantize; the checkpoint is then read one tensor at a time (``pread``, dropped from the page
cache) and written one tensor at a time: each such weight as int8 (out, in) plus its fp32
``scales`` (out,), every other tensor as it was stored. So converting a model larger than the
RAM holds one tensor at a time. ``config.json`` gets ``tierflow_quantization``, which
``tierflow generate`` reads to build ``Int8Linear`` layers (and training refuses). The copy is
written beside ``--out`` and renamed into place when complete: an interrupted conversion leaves
no half-written model behind.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from ..core.errors import TierflowError
from ..core.units import format_bytes
from ..models.files import read_config_json
from ..models.int8 import (
    INT8,
    QUANTIZATION_KEY,
    is_quantized,
    quantizable,
    quantize_weight,
)
from ..models.safetensors_io import StoredTensor, read_tensor
from .memory import stored_tensors
from .options import check_new_directory

PROGRESS_EVERY_S = 5.0
_COPIED_FILES = ("tokenizer.json", "generation_config.json")


def _layout(directory: Path, names: set[str]) -> tuple[dict[str, str], dict[str, bool]]:
    """({checkpoint name: model name} of ``names``, {quantized module name: stored
    transposed})."""
    from ..models.load import _match_names, build_on_meta
    model = build_on_meta(directory, None)
    return _match_names(model, names), quantizable(model)


def quantize_checkpoint(model_dir: Path, out: Path, *, log: TextIO | None = None) -> Path:
    """Write ``out``: ``model_dir``'s model with int8 linear weights (see the module
    docstring). Returns ``out``."""
    log = log if log is not None else sys.stderr
    config = read_config_json(model_dir)
    if is_quantized(config):
        raise TierflowError(f"{model_dir} is already quantized ({QUANTIZATION_KEY} in its "
                            "config.json): quantize the checkpoint it was made from")
    check_new_directory(out)
    stored = stored_tensors(model_dir)
    rename, layers = _layout(model_dir, set(stored))
    plan: dict[str, tuple[StoredTensor, torch.Tensor]] = {}  # out name: (source, meta tensor)
    for name in sorted(stored, key=lambda n: (str(stored[n].file), stored[n].offset)):
        source, target = stored[name], rename[name]
        module, _, leaf = target.rpartition(".")
        if leaf == "weight" and module in layers:
            n_out = source.shape[1] if layers[module] else source.shape[0]
            n_in = source.shape[0] if layers[module] else source.shape[1]
            plan[target] = (source, torch.empty(n_out, n_in, dtype=torch.int8,
                                                device="meta"))
            plan[f"{module}.scales"] = (source, torch.empty(n_out, device="meta"))
        else:
            plan[target] = (source, torch.empty(source.shape, dtype=source.dtype, device="meta"))

    started, shown = time.perf_counter(), time.perf_counter()
    fds = {file: os.open(file, os.O_RDONLY) for file in {t.file for t in stored.values()}}
    last: dict[str, torch.Tensor] = {}  # the scales of the weight just quantized

    def materialize(name: str, meta: torch.Tensor) -> torch.Tensor:
        nonlocal shown
        source = plan[name][0]
        if name.endswith(".scales") and name in last:
            return last.pop(name)
        if meta.dtype != torch.int8:  # not a linear layer's weight: copied as stored
            return read_tensor(fds[source.file], source, source.dtype)
        weight = read_tensor(fds[source.file], source, torch.float32)
        module = name.rpartition(".")[0]
        q, scales = quantize_weight(weight.t() if layers[module] else weight)
        last[f"{module}.scales"] = scales
        if time.perf_counter() - shown > PROGRESS_EVERY_S:
            shown = time.perf_counter()
            print(f"[quantize] {module} ...", file=log, flush=True)
        return q.contiguous()

    from ..train.checkpoint import write_safetensors
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        write_safetensors(partial / "model.safetensors",
                          {name: meta for name, (_, meta) in plan.items()}, materialize=materialize)
        for name in _COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, partial / name)
        (partial / "config.json").write_text(json.dumps({**config, QUANTIZATION_KEY: INT8},
                                                        indent=2) + "\n")
        os.rename(partial, out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise TierflowError(f"writing {out} failed ({e.strerror or e}); nothing was left "
                            "behind: free space on that disk or give another --out") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    before = sum(t.nbytes for t in stored.values())
    after = (out / "model.safetensors").stat().st_size
    print(f"[quantize] {len(layers)} linear layers to int8 in {time.perf_counter() - started:.1f}"
          f" s: {format_bytes(before)} -> {format_bytes(after)}; {out}", file=log, flush=True)
    return out
