"""What a checkpoint's values become on disk: JSON with tagged tensors, tuples and odd keys;
optimizer state dicts split into safetensors tensors and JSON; RNG states; run hashes and the
run identity they hash (the architecture, read from a config without loading weights).

Pure encoding, no files: ``checkpoint.py`` writes and reads the files. Nothing here is
ever unpickled: tensors travel as base64 with dtype and shape, or as safetensors entries.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..core.errors import TierflowError

# ---------------------------------------------------------------------------------------------
# JSON for nested Python values that hold tensors

def _encode(value: Any, path: str, put: Callable[[str, torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return put(path, value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", put) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}.{i}", put) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{path}.{k}", put) for k, v in value.items()}
        return {"__items__": [[_encode(k, f"{path}.key", put), _encode(v, f"{path}.{k}", put)]
                              for k, v in value.items()]}
    if type(value).__module__ == "numpy":
        import numpy as np
        if isinstance(value, np.ndarray):
            return {"__ndarray__": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode(),
                    "dtype": value.dtype.str, "shape": list(value.shape)}
        if isinstance(value, np.generic):
            return _encode(value.item(), path, put)
    raise TierflowError(f"cannot store a {type(value).__name__} at {path.lstrip('.')} in a "
                        "checkpoint: use numbers, strings, lists, dicts, tuples or tensors")


def _decode(value: Any, get: Callable[[Any], torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, get) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v, get) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, get): _decode(v, get) for k, v in value["__items__"]}
    if "__float__" in value:
        return float(value["__float__"])
    if "__tensor__" in value:
        return get(value)
    if "__ndarray__" in value:
        import numpy as np
        data = base64.b64decode(value["__ndarray__"])
        return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    return {k: _decode(v, get) for k, v in value.items()}


def raw_bytes(t: torch.Tensor):
    """The bytes of ``t`` (little-endian, row-major) as a buffer, without copying a CPU tensor."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""


def _inline_tensor(_path: str, t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    return {"__tensor__": base64.b64encode(bytes(raw_bytes(t))).decode(),
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _inline_decode(value: dict) -> torch.Tensor:
    dtype = getattr(torch, value["dtype"])
    data = base64.b64decode(value["__tensor__"])
    if not data:
        return torch.empty(value["shape"], dtype=dtype)
    stored = torch.uint8 if dtype == torch.bool else dtype
    return torch.frombuffer(bytearray(data), dtype=stored).reshape(value["shape"]).to(dtype)


def to_json(value: Any) -> Any:
    """``value`` as plain JSON data, tensors inline as base64 (``from_json`` inverts it)."""
    return _encode(value, "", _inline_tensor)


def from_json(data: Any) -> Any:
    return _decode(data, _inline_decode)


def config_hash(value: Any) -> str:
    """A stable hash of a configuration (dicts, lists, numbers, strings, tensors): resume
    compares it to refuse a checkpoint of a different run."""
    text = json.dumps(to_json(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# the identity of a run: what must match for a checkpoint to be resumed

def spec_arch(spec: str, vocab_size: int) -> dict[str, Any]:
    """The architecture ``--model spec`` names, read without loading any weight."""
    from ..models.load import read_config
    from ..models.presets import PRESETS, preset_config
    if spec in PRESETS:
        return _config_arch(preset_config(spec, vocab_size=vocab_size))
    path = Path(spec)
    if not path.is_dir():
        raise TierflowError(f"--model {spec!r} is neither a preset nor a directory: pass the "
                            "model the checkpoint was trained from, or leave --model out")
    return _config_arch(read_config(path))


def model_arch(model) -> dict[str, Any]:
    """The architecture fields of a loaded model's config."""
    return _config_arch(model.config)


def _config_arch(config) -> dict[str, Any]:
    config = config.to_dict()
    keep = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
            "intermediate_size", "n_inner", "num_attention_heads", "n_head",
            "num_key_value_heads", "tie_word_embeddings")
    return {k: config[k] for k in keep if k in config}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key: checkpoint A, now B`` for every (nested) value that differs."""
    diffs = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key} {d}" for d in differences(a, b)]
        elif a != b:
            diffs.append(f"{key}: checkpoint {a!r}, now {b!r}")
    return diffs


# ---------------------------------------------------------------------------------------------
# optimizer states <-> (tensors, JSON)

def flatten_optimizer_states(states: Sequence[dict | None]) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a list of torch optimizer ``state_dict()``s (one per stage; None for a stage
    without parameters) into a flat ``{name: tensor}`` dict and a JSON structure holding
    everything else. Names are ``opt.<stage>.<path>``: ``opt.0.state.3.exp_avg`` is the
    first moment of parameter 3 of stage 0; tensors in param_groups are named the same way."""
    tensors: dict[str, torch.Tensor] = {}

    def put(path: str, t: torch.Tensor) -> dict:
        name = path.lstrip(".")
        while name in tensors:
            name += "_"
        tensors[name] = t.detach()
        return {"__tensor__": name}

    structure = [_encode(s, f"opt.{i}", put) for i, s in enumerate(states)]
    return tensors, structure


def unflatten_optimizer_states(tensors: dict[str, torch.Tensor],
                               structure: Any) -> list[dict | None]:
    """Inverse of ``flatten_optimizer_states``: the list of state dicts to hand to each
    stage's ``optimizer.load_state_dict``."""
    def get(ref: dict) -> torch.Tensor:
        name = ref["__tensor__"]
        if name not in tensors:
            raise TierflowError(f"optimizer state names tensor {name}, which is not in the "
                                "optimizer file: the checkpoint is damaged; resume from an "
                                "earlier step_N")
        return tensors[name]

    return [_decode(s, get) for s in structure]


# ---------------------------------------------------------------------------------------------
# RNG

def capture_rng() -> dict:
    """The state of every random generator a training step may draw from."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    """Put back what ``capture_rng`` returned (after a trip through a checkpoint)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
